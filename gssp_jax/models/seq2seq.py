"""GRU encoder-decoder with additive (Bahdanau) attention.

Follows bentrevett/pytorch-seq2seq tutorial 3 ("Neural Machine Translation by
Jointly Learning to Align and Translate"). Both the teacher-forced path and
greedy decoding run one shared `DecoderStep` module inside `nn.scan`, so they
use the same parameters and compile to a loop rather than an unrolled graph.

Token conventions: PAD=0 (default `pad_id`), BOS and EOS ids are passed to
`Seq2Seq.greedy_decode`. Every source sequence must have `src_len >= 1`.
"""

import flax.linen as nn
import jax.numpy as jnp

# Added to attention scores at PAD positions; exp() of it underflows to exactly 0.
_MASK_VALUE = -1e9


class Encoder(nn.Module):
  """Embedding + dropout + bidirectional GRU.

  Attributes:
    vocab_size: source vocabulary size.
    emb_dim: embedding size.
    hidden_dim: GRU size per direction (and decoder hidden size).
    dropout_rate: dropout on the embeddings.
  """

  vocab_size: int
  emb_dim: int
  hidden_dim: int
  dropout_rate: float

  @nn.compact
  def __call__(self, src, src_len, train: bool):
    """Encodes a padded source batch.

    Args:
      src: int tokens [B, Ls].
      src_len: int lengths [B]; positions >= src_len are ignored.
      train: enables dropout.

    Returns:
      (outputs [B, Ls, 2*hidden_dim], initial decoder hidden [B, hidden_dim]).
      Outputs at padded positions are unspecified and must be masked.
    """
    x = nn.Embed(self.vocab_size, self.emb_dim, name="embed")(src)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
    # With seq_lengths, the forward carry is taken at position src_len-1 and the
    # backward RNN starts at src_len-1, so padding never reaches either carry.
    # Cells built here are owned by this module (flax binds them to the
    # enclosing compact scope), hence the explicit names.
    birnn = nn.Bidirectional(
        nn.RNN(nn.GRUCell(self.hidden_dim, name="gru_forward")),
        nn.RNN(nn.GRUCell(self.hidden_dim, name="gru_backward")),
        return_carry=True,
    )
    (h_fwd, h_bwd), outputs = birnn(x, seq_lengths=src_len)
    hidden = jnp.tanh(
        nn.Dense(self.hidden_dim, name="bridge")(jnp.concatenate([h_fwd, h_bwd], -1)))
    return outputs, hidden


class Attention(nn.Module):
  """Additive attention: v^T tanh(W [hidden; enc_output] + b).

  The dense layer on the concatenation is split into a query part (no bias)
  and a key part (with bias); this is the same function with the same
  parameter count, but lets the key part be computed once per source
  sentence instead of once per decoder step.
  """

  hidden_dim: int

  def setup(self):
    self.query_proj = nn.Dense(self.hidden_dim, use_bias=False)
    self.key_proj = nn.Dense(self.hidden_dim)
    self.score = nn.Dense(1, use_bias=False)

  def keys(self, enc_outputs):
    """Projects encoder outputs [B, Ls, 2H] -> [B, Ls, H] (loop invariant)."""
    return self.key_proj(enc_outputs)

  def __call__(self, hidden, keys, enc_outputs, mask):
    """Returns the attention-weighted encoder context [B, 2H].

    Args:
      hidden: decoder hidden state [B, H].
      keys: `self.keys(enc_outputs)`, [B, Ls, H].
      enc_outputs: encoder outputs [B, Ls, 2H].
      mask: bool [B, Ls], True at real (non-PAD) source positions.
    """
    energy = jnp.tanh(self.query_proj(hidden)[:, None, :] + keys)
    scores = self.score(energy)[..., 0]
    scores = jnp.where(mask, scores, _MASK_VALUE)
    weights = nn.softmax(scores, axis=-1)
    return jnp.einsum("bl,bld->bd", weights, enc_outputs)


class DecoderStep(nn.Module):
  """One decoder time step; scanned over time by `Seq2Seq`.

  Attributes:
    vocab_size: target vocabulary size.
    emb_dim: embedding size.
    hidden_dim: GRU hidden size.
    dropout_rate: dropout on the embeddings.
  """

  vocab_size: int
  emb_dim: int
  hidden_dim: int
  dropout_rate: float

  def setup(self):
    self.embed = nn.Embed(self.vocab_size, self.emb_dim)
    self.dropout = nn.Dropout(self.dropout_rate)
    self.attention = Attention(self.hidden_dim)
    self.gru = nn.GRUCell(self.hidden_dim)
    self.out = nn.Dense(self.vocab_size)

  def attention_keys(self, enc_outputs):
    """Loop-invariant part of the attention; call once before scanning."""
    return self.attention.keys(enc_outputs)

  def __call__(self, hidden, token, enc_outputs, keys, mask, train: bool):
    """Advances the decoder by one token.

    Args:
      hidden: [B, H] previous hidden state.
      token: int [B] current input token.
      enc_outputs, keys, mask: encoder outputs, `attention_keys(enc_outputs)`
        and the source mask (see `Attention`).
      train: enables dropout.

    Returns:
      (new hidden [B, H], float32 logits [B, vocab_size]).
    """
    embedded = self.dropout(self.embed(token), deterministic=not train)
    weighted = self.attention(hidden, keys, enc_outputs, mask)
    hidden, output = self.gru(hidden, jnp.concatenate([embedded, weighted], -1))
    logits = self.out(jnp.concatenate([output, weighted, embedded], -1))
    return hidden, logits


def _scan(body, in_axes, length=None):
  """nn.scan over time with shared params and a fresh dropout mask per step."""
  return nn.scan(
      body,
      variable_broadcast="params",
      split_rngs={"params": False, "dropout": True},
      in_axes=in_axes,
      out_axes=1,  # Stack per-step outputs on axis 1: [B, T, ...].
      length=length,
  )


class Seq2Seq(nn.Module):
  """Attention GRU encoder-decoder.

  Call conventions::

    variables = model.init({"params": k1, "dropout": k2}, src, src_len, tgt_in)
    logits = model.apply(variables, src, src_len, tgt_in, train=True,
                         rngs={"dropout": key})            # [B, Lt, V] f32
    tokens = model.apply(variables, src, src_len, max_len=50, bos_id=2,
                         eos_id=3, method=Seq2Seq.greedy_decode)  # [B, max_len]

  Attributes:
    src_vocab_size: source vocabulary size.
    tgt_vocab_size: target vocabulary size.
    emb_dim: embedding size (encoder and decoder).
    hidden_dim: GRU hidden size (per direction in the encoder).
    dropout: dropout rate on encoder and decoder embeddings.
  """

  src_vocab_size: int
  tgt_vocab_size: int
  emb_dim: int = 256
  hidden_dim: int = 512
  dropout: float = 0.5

  def setup(self):
    self.encoder = Encoder(self.src_vocab_size, self.emb_dim, self.hidden_dim,
                           self.dropout)
    self.decoder = DecoderStep(self.tgt_vocab_size, self.emb_dim, self.hidden_dim,
                               self.dropout)

  def _encode(self, src, src_len, train):
    enc_outputs, hidden = self.encoder(src, src_len, train)
    keys = self.decoder.attention_keys(enc_outputs)
    mask = jnp.arange(src.shape[1])[None, :] < src_len[:, None]
    return hidden, (enc_outputs, keys, mask)

  def __call__(self, src, src_len, tgt_in, train: bool = False):
    """Teacher-forced logits.

    Args:
      src: int tokens [B, Ls], PAD beyond src_len.
      src_len: int [B], each >= 1.
      tgt_in: int decoder inputs [B, Lt] (BOS + target without its last token).
      train: enables dropout (needs a "dropout" rng).

    Returns:
      float32 logits [B, Lt, tgt_vocab_size]; step t predicts tgt[:, t + 1].
    """
    hidden, context = self._encode(src, src_len, train)

    def body(step, hidden, token, enc_outputs, keys, mask):
      return step(hidden, token, enc_outputs, keys, mask, train)

    scan = _scan(body, in_axes=(1, nn.broadcast, nn.broadcast, nn.broadcast))
    _, logits = scan(self.decoder, hidden, tgt_in, *context)
    return logits

  def greedy_decode(self, src, src_len, max_len: int, bos_id: int, eos_id: int,
                    pad_id: int = 0, return_logits: bool = False):
    """Greedy decoding (dropout off), jittable with static `max_len`.

    Each step feeds back the argmax token. Output positions after the first
    EOS are filled with `pad_id`; the EOS itself is kept.

    Args:
      src: int tokens [B, Ls].
      src_len: int [B], each >= 1.
      max_len: number of tokens to generate (static).
      bos_id: first decoder input.
      eos_id: end-of-sentence id.
      pad_id: filler after EOS.
      return_logits: also return the per-step logits.

    Returns:
      int32 tokens [B, max_len] (excluding BOS); with `return_logits`, also
      float32 logits [B, max_len, tgt_vocab_size]. The logits are those of the
      argmax continuation, also past EOS, i.e. they equal the teacher-forced
      logits for tgt_in = [BOS, argmax tokens[:-1]].
    """
    hidden, context = self._encode(src, src_len, train=False)
    batch = src.shape[0]

    def body(step, carry, enc_outputs, keys, mask):
      hidden, token, done = carry
      hidden, logits = step(hidden, token, enc_outputs, keys, mask, False)
      next_token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      out = jnp.where(done, pad_id, next_token)
      done = done | (next_token == eos_id)
      # Stack the [B, V] logits only when asked: they dominate memory.
      return (hidden, next_token, done), ((out, logits) if return_logits else out)

    scan = _scan(body, in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
                 length=max_len)
    carry = (hidden, jnp.full((batch,), bos_id, jnp.int32), jnp.zeros((batch,), bool))
    _, outputs = scan(self.decoder, carry, *context)
    return outputs
