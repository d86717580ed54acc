"""Tests for gssp_jax.models: parameter counts, shapes, BatchNorm, Seq2Seq."""

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gssp_jax.models import (MODELS, LeNet5, ResNet18, Seq2Seq, VGG19, create_model,
                             has_batch_stats, param_count)
from gssp_jax.models.layers import conv_general_dilated, max_pool_2x2

BOS, EOS = 2, 3


def _images(channels, batch=2, seed=0):
  return jax.random.normal(jax.random.key(seed), (batch, 32, 32, channels))


def _abstract_init(model, *args, **kwargs):
  """Shapes of model.init without running (or compiling) anything."""
  return jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs))


# ---------------------------------------------------------------- registry


def test_registry():
  assert MODELS == ("lenet5", "resnet18", "vgg19", "seq2seq")
  assert isinstance(create_model("lenet5", num_classes=10), LeNet5)
  assert isinstance(create_model("resnet18", num_classes=10), ResNet18)
  assert isinstance(create_model("vgg19", num_classes=100), VGG19)
  assert isinstance(create_model("seq2seq", src_vocab_size=5, tgt_vocab_size=6), Seq2Seq)


def test_unknown_model_raises():
  with pytest.raises(ValueError, match="model='foo' is unknown; allowed: lenet5, resnet18, vgg19, seq2seq, a name given"):
    create_model("foo")


# ---------------------------------------------------------------- layers


@pytest.mark.parametrize("hw, strides, padding", [
    (2, (1, 1), ((1, 1), (1, 1))),  # Fast path (VGG-19's last stage).
    (1, (1, 1), ((1, 1), (1, 1))),  # Fast path.
    (2, (1, 1), ((0, 2), (1, 0))),  # Fast path, asymmetric padding.
    (4, (1, 1), ((1, 1), (1, 1))),  # Falls back to lax.
    (2, (2, 2), ((1, 1), (1, 1))),  # Falls back to lax.
])
@pytest.mark.usefixtures("highest_precision")   # exactness: float32, not a GPU's TF32
def test_small_map_conv_matches_lax(hw, strides, padding):
  x = jax.random.normal(jax.random.key(0), (3, hw, hw, 5))
  k = jax.random.normal(jax.random.key(1), (3, 3, 5, 7))
  dn = ("NHWC", "HWIO", "NHWC")

  def loss(conv, x, k):
    dims = jax.lax.conv_dimension_numbers(x.shape, k.shape, dn)
    return jnp.sum(jnp.sin(conv(x, k, strides, padding, dimension_numbers=dims)))

  ours = jax.jit(jax.value_and_grad(partial(loss, conv_general_dilated), (0, 1)))(x, k)
  ref = jax.jit(jax.value_and_grad(partial(loss, jax.lax.conv_general_dilated), (0, 1)))(x, k)
  for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_max_pool_2x2_matches_flax():
  x = jax.nn.relu(jax.random.normal(jax.random.key(0), (2, 6, 8, 3)))
  np.testing.assert_array_equal(max_pool_2x2(x), nn.max_pool(x, (2, 2), strides=(2, 2)))


# ---------------------------------------------------------------- classifiers


def _conv(k, cin, cout, bias):
  return k * k * cin * cout + (cout if bias else 0)


def _bn(c):  # scale + bias; running mean/var live in batch_stats.
  return 2 * c


def _dense(fin, fout):
  return fin * fout + fout


# LeNet-5: 156 + 2,416 + 48,120 + 10,164 + 850.
LENET_PARAMS = (_conv(5, 1, 6, True) + _conv(5, 6, 16, True) + _dense(400, 120)
                + _dense(120, 84) + _dense(84, 10))


def _basic_block(cin, cout, stride):
  n = _conv(3, cin, cout, False) + _bn(cout) + _conv(3, cout, cout, False) + _bn(cout)
  if stride != 1 or cin != cout:
    n += _conv(1, cin, cout, False) + _bn(cout)  # Projection shortcut.
  return n


# ResNet-18 (CIFAR): stem 1,856 + stages 147,968 / 525,568 / 2,099,712 /
# 8,393,728 + classifier 5,130.
RESNET_PARAMS = (_conv(3, 3, 64, False) + _bn(64)
                 + _basic_block(64, 64, 1) + _basic_block(64, 64, 1)
                 + _basic_block(64, 128, 2) + _basic_block(128, 128, 1)
                 + _basic_block(128, 256, 2) + _basic_block(256, 256, 1)
                 + _basic_block(256, 512, 2) + _basic_block(512, 512, 1)
                 + _dense(512, 10))


def _vgg19_params(num_classes):
  # Each conv: 9*cin*cout + cout (bias) + 2*cout (BN). Channels:
  # 3->64->64 | ->128->128 | ->256 x4 | ->512 x4 | 512->512 x4, then 512->classes.
  # = 38,720 + 221,440 + 2,100,480 + 8,270,848 + 9,443,328 + 5,130 = 20,040,522.
  n, cin = 0, 3
  for cout in (64, 64, 128, 128, 256, 256, 256, 256, *(512,) * 8):
    n += _conv(3, cin, cout, True) + _bn(cout)
    cin = cout
  return n + _dense(512, num_classes)


@pytest.mark.parametrize("name, expected", [("resnet18", 701_466), ("vgg19", 1_256_922)])
def test_quarter_width_models_of_the_reduced_sweeps(name, expected):
  model = create_model(name, num_classes=10, width=0.25)
  variables = _abstract_init(model, _images(3), train=False)
  assert param_count(variables["params"]) == expected
  if name == "vgg19":   # the formula with every channel count divided by 4
    n, cin = 0, 3
    for cout in (16, 16, 32, 32, 64, 64, 64, 64, *(128,) * 8):
      n += _conv(3, cin, cout, True) + _bn(cout)
      cin = cout
    assert n + _dense(128, 10) == expected
  with pytest.raises(ValueError, match=r"model width=0 is invalid"):
    _abstract_init(create_model(name, num_classes=10, width=0), _images(3), train=False)


@pytest.mark.parametrize("name, channels, expected, formula", [
    ("lenet5", 1, 61_706, LENET_PARAMS),
    ("resnet18", 3, 11_173_962, RESNET_PARAMS),
    ("vgg19", 3, 20_040_522, _vgg19_params(10)),
])
def test_classifier_param_counts(name, channels, expected, formula):
  assert formula == expected
  model = create_model(name, num_classes=10)
  variables = _abstract_init(model, _images(channels), train=False)
  assert param_count(variables["params"]) == expected
  assert has_batch_stats(variables) == (name != "lenet5")
  out = jax.eval_shape(lambda v: model.apply(v, _images(channels), train=False), variables)
  assert out.shape == (2, 10) and out.dtype == jnp.float32


@pytest.mark.parametrize("name", ["resnet18", "vgg19"])
def test_bfloat16_compute_keeps_float32_params_and_logits(name):
  model = create_model(name, num_classes=100, dtype=jnp.bfloat16)
  variables = _abstract_init(model, _images(3), train=False)
  assert {x.dtype for x in jax.tree_util.tree_leaves(variables)} == {jnp.dtype(jnp.float32)}
  out = jax.eval_shape(lambda v: model.apply(v, _images(3), train=False), variables)
  assert out.shape == (2, 100) and out.dtype == jnp.float32


@pytest.mark.parametrize("model_cls", [ResNet18, VGG19])
def test_batchnorm_train_and_eval(model_cls):
  model = model_cls(num_classes=10)
  x = _images(3)
  variables = model.init(jax.random.key(0), x, train=False)

  @jax.jit
  def run(variables, x):
    train_logits, state = model.apply(variables, x, train=True, mutable=["batch_stats"])
    return train_logits, state, model.apply(variables, x, train=False)

  train_logits, state, eval_logits = run(variables, x)
  assert train_logits.shape == eval_logits.shape == (2, 10)
  assert train_logits.dtype == eval_logits.dtype == jnp.float32
  assert np.all(np.isfinite(train_logits)) and np.all(np.isfinite(eval_logits))
  # Running statistics moved towards the batch statistics.
  old, new = variables["batch_stats"], state["batch_stats"]
  assert jax.tree_util.tree_structure(old) == jax.tree_util.tree_structure(new)
  assert all(not np.allclose(a, b) for a, b in
             zip(jax.tree_util.tree_leaves(old), jax.tree_util.tree_leaves(new)))
  # Eval mode is deterministic and uses running stats (differs from train mode).
  np.testing.assert_array_equal(eval_logits, run(variables, x)[2])
  assert not np.allclose(train_logits, eval_logits)


def test_lenet_train_mode_and_one_sgd_step():
  model = LeNet5(num_classes=10)
  x = _images(1, batch=8)
  labels = jnp.arange(8) % 10
  variables = jax.jit(lambda x: model.init(jax.random.key(0), x, train=False))(x)
  logits, state = jax.jit(partial(model.apply, train=True, mutable=["batch_stats"]))(
      variables, x)
  assert logits.shape == (8, 10) and logits.dtype == jnp.float32
  assert not jax.tree_util.tree_leaves(state)  # No BatchNorm: empty collection.
  assert not has_batch_stats(variables)
  np.testing.assert_allclose(logits, jax.jit(model.apply)(variables, x), rtol=1e-6)

  @jax.jit
  def loss_fn(params):
    logits = model.apply({"params": params}, x, train=True)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  params = variables["params"]
  loss0, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
  assert all(np.any(g != 0) for g in jax.tree_util.tree_leaves(grads))
  params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
  assert loss_fn(params) < loss0


# ---------------------------------------------------------------- seq2seq

SRC_V, TGT_V, EMB, HID = 50, 60, 16, 24


def _gru_params(inputs, hidden):
  # flax GRUCell: input kernels ir/iz/in with bias, hidden kernels hr/hz without
  # bias and hn with bias -> 3*(I*H + H) + 3*H*H + H.
  return 3 * (inputs * hidden + hidden) + 3 * hidden * hidden + hidden


def _seq2seq_params(vs, vt, e, h):
  encoder = (vs * e                   # embedding
             + 2 * _gru_params(e, h)  # forward + backward GRU
             + _dense(2 * h, h))      # bridge: tanh(W [h_fwd; h_bwd] + b)
  attention = (h * h                  # query part of W (no bias)
               + _dense(2 * h, h)     # key part of W, carrying the bias
               + h)                   # v (no bias)
  decoder = (vt * e + attention
             + _gru_params(e + 2 * h, h)   # input = [embedded; weighted]
             + _dense(h + 2 * h + e, vt))  # out([output; weighted; embedded])
  return encoder + decoder


def _seq2seq(dropout=0.5):
  return create_model("seq2seq", src_vocab_size=SRC_V, tgt_vocab_size=TGT_V,
                      emb_dim=EMB, hidden_dim=HID, dropout=dropout)


@pytest.fixture(scope="module")
def s2s():
  """A small model, its variables, a padded batch (row 1 has length 4) and a
  jitted teacher-forced forward(variables, src, src_len, tgt_in, seed=None)."""
  model = _seq2seq()
  src = jax.random.randint(jax.random.key(1), (2, 7), 4, SRC_V).at[1, 4:].set(0)
  src_len = jnp.array([7, 4])
  tgt_in = jax.random.randint(jax.random.key(2), (2, 5), 4, TGT_V).at[:, 0].set(BOS)
  variables = jax.jit(model.init, static_argnames="train")(
      {"params": jax.random.key(0), "dropout": jax.random.key(3)},
      src, src_len, tgt_in, train=False)

  @jax.jit
  def forward(variables, src, src_len, tgt_in, seed=None):
    if seed is None:
      return model.apply(variables, src, src_len, tgt_in, train=False)
    return model.apply(variables, src, src_len, tgt_in, train=True,
                       rngs={"dropout": jax.random.key(seed)})

  return model, variables, src, src_len, tgt_in, forward


def test_seq2seq_param_count():
  # Tutorial-sized model with Multi30k-like vocabularies.
  model = create_model("seq2seq", src_vocab_size=7853, tgt_vocab_size=5893)
  src, tgt = jnp.ones((2, 9), jnp.int32), jnp.ones((2, 6), jnp.int32)
  variables = _abstract_init(model, src, jnp.array([9, 5]), tgt, train=False)
  assert set(variables) == {"params"}
  assert param_count(variables["params"]) == _seq2seq_params(7853, 5893, 256, 512)


def test_seq2seq_shapes_and_determinism(s2s):
  _, variables, src, src_len, tgt_in, forward = s2s
  assert param_count(variables["params"]) == _seq2seq_params(SRC_V, TGT_V, EMB, HID)
  logits = forward(variables, src, src_len, tgt_in)
  assert logits.shape == (2, 5, TGT_V) and logits.dtype == jnp.float32
  np.testing.assert_array_equal(logits, forward(variables, src, src_len, tgt_in))
  train_logits = lambda seed: forward(variables, src, src_len, tgt_in, seed)
  assert not np.allclose(train_logits(0), logits)  # Dropout active.
  assert not np.allclose(train_logits(0), train_logits(1))
  np.testing.assert_array_equal(train_logits(0), train_logits(0))


def test_seq2seq_ignores_source_padding(s2s):
  _, variables, src, src_len, tgt_in, forward = s2s
  logits = forward(variables, src, src_len, tgt_in)
  # Append 3 more positions and fill everything beyond src_len with junk tokens.
  longer = jnp.concatenate([src, jnp.zeros((2, 3), src.dtype)], axis=1)
  junk = jnp.arange(10) >= src_len[:, None]
  longer = jnp.where(junk, 17, longer)
  np.testing.assert_allclose(forward(variables, longer, src_len, tgt_in), logits,
                             atol=1e-5, rtol=1e-5)


def test_seq2seq_gradients_reach_all_params(s2s):
  model, variables, src, src_len, tgt_in, _ = s2s

  def loss_fn(params):
    logits = model.apply({"params": params}, src, src_len, tgt_in, train=True,
                         rngs={"dropout": jax.random.key(0)})
    return optax.softmax_cross_entropy_with_integer_labels(logits, tgt_in).mean()

  grads = jax.jit(jax.grad(loss_fn))(variables["params"])
  assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))
  assert all(np.any(g != 0) for g in jax.tree_util.tree_leaves(grads))


def test_greedy_decode_matches_teacher_forcing(s2s):
  model, variables, src, src_len, _, forward = s2s
  max_len = 6
  decode = jax.jit(lambda v: model.apply(
      v, src, src_len, max_len=max_len, bos_id=BOS, eos_id=EOS, return_logits=True,
      method=Seq2Seq.greedy_decode))
  tokens, logits = decode(variables)
  assert tokens.shape == (2, max_len) and tokens.dtype == jnp.int32
  assert logits.shape == (2, max_len, TGT_V)
  # Feeding the greedy choices back with teacher forcing reproduces every step.
  argmax = jnp.argmax(logits, -1)
  tgt_in = jnp.concatenate([jnp.full((2, 1), BOS), argmax[:, :-1]], axis=1)
  np.testing.assert_allclose(forward(variables, src, src_len, tgt_in), logits,
                             atol=1e-5, rtol=1e-5)
  # Tokens are the argmax up to and including the first EOS, PAD (0) after it.
  is_eos = argmax == EOS
  after_eos = jnp.cumsum(is_eos, axis=1) - is_eos > 0
  np.testing.assert_array_equal(tokens, jnp.where(after_eos, 0, argmax))


def test_greedy_decode_pads_after_eos(s2s):
  model, variables, src, src_len, _, _ = s2s
  # Force EOS everywhere by making its output bias dominate.
  params = jax.tree_util.tree_map(lambda x: x, variables["params"])
  params["decoder"]["out"]["bias"] = params["decoder"]["out"]["bias"].at[EOS].set(1e4)
  tokens = model.apply({"params": params}, src, src_len, max_len=4, bos_id=BOS,
                       eos_id=EOS, method=Seq2Seq.greedy_decode)
  np.testing.assert_array_equal(tokens, [[EOS, 0, 0, 0]] * 2)
