"""Who may call a real run's servers: a per-run secret on every call, optional TLS, receipts.

Every process of a run holds the same **run secret**: 256 random bits, written
as 64 hexadecimal characters, handed over by the environment
(``GSSP_SECRET``) or by a file only its owner can read (``GSSP_SECRET_FILE``,
mode 0600, as ssh keys). The one-host launcher makes a fresh one per run; on
a cluster the user makes one file and points every host at it::

  umask 077; python -c "import secrets; print(secrets.token_hex(32))" > ~/.gssp_secret
  export GSSP_SECRET_FILE=~/.gssp_secret

The secret itself never travels and is never logged, nor written to
``summary.json`` or ``config.json``. Calls carry a token derived from it with
HMAC-SHA256 over the **run id** (``GSSP_RUN_ID``, the same on every process of
a run, a new one per run; not secret; the one-host launcher makes one), so a
token seen in one run opens no other (``Credentials.token``), checked by a server interceptor
(:class:`TokenInterceptor`) in constant time before any handler runs. Without
TLS the token crosses the network in clear text, so anyone who can read the
cluster's traffic can replay it: on a network you do not trust, add TLS
(``dist.tls_*``), which encrypts and, with ``dist.tls_client_auth``, checks a
certificate of every client too.

A shard acknowledges the gradient slice it staged with a **receipt**, an HMAC
of (shard, mesh, push number, session, size, the slice's SHA-256) under another
key derived from the secret; the control plane applies a push only when the
mesh hands it a valid receipt from every other shard for the digests the mesh
computed of its own slices, and tells each shard which digest to apply, so no
shard is ever asked to apply a gradient it did not receive and check, nor one
that another caller staged under the mesh's number. Everything here is the standard
library's ``hmac``/``secrets`` and gRPC's own credentials: no cryptography is
written by hand.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
import threading
import time

from absl import logging
import grpc

SECRET_ENV = "GSSP_SECRET"
SECRET_FILE_ENV = "GSSP_SECRET_FILE"
RUN_ID_ENV = "GSSP_RUN_ID"                 # names the run: tokens and receipts are this run's only
RUN_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
MAKE_RUN_ID = ("export GSSP_RUN_ID=$(python -c \"import secrets; print(secrets.token_hex(8))\")")
SECRET_HEX_CHARS = 64                      # 256 bits
TOKEN_KEY = "gssp-token"                   # the call metadata that carries the token
MAKE_ONE = ('umask 077; python -c "import secrets; print(secrets.token_hex(32))" > '
            "~/.gssp_secret; export GSSP_SECRET_FILE=~/.gssp_secret")


class SecretError(ValueError):
  """No usable run secret: the message says what was wrong and how to make one."""


def new_secret() -> str:
  """A fresh run secret: 256 bits from ``secrets``, as 64 hexadecimal characters."""
  return secrets.token_hex(SECRET_HEX_CHARS // 2)


def parse_secret(text: str, source: str) -> bytes:
  """The 32 bytes of a secret written as 64 hex characters; raises SecretError naming ``source``."""
  text = text.strip()
  if len(text) != SECRET_HEX_CHARS or any(c not in "0123456789abcdefABCDEF" for c in text):
    raise SecretError(f"the run secret from {source} is invalid ({len(text)} characters); "
                      f"allowed: {SECRET_HEX_CHARS} hexadecimal characters (256 bits). Make one:"
                      f" {MAKE_ONE}")
  return bytes.fromhex(text)


def read_secret_file(path: str) -> bytes:
  """The secret in ``path``: a regular file (not a symbolic link) of this user's, that no one
  else may read or write.

  The checks are made on the file opened (``fstat`` of its descriptor), so the
  file cannot be swapped between the check and the read; a file of another
  user (a stranger who made it first, say in a shared ``/tmp`` workdir) is
  refused even with mode 0600.
  """
  where = f"{SECRET_FILE_ENV}={path!r}"
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
  except OSError as e:
    reason = "it is a symbolic link" if e.errno == errno.ELOOP else e.strerror
    raise SecretError(f"{where} cannot be read ({reason}); allowed: a regular file of yours, "
                      f"mode 0600. Make one: {MAKE_ONE}") from None
  with os.fdopen(fd) as f:
    info = os.fstat(f.fileno())
    if not stat.S_ISREG(info.st_mode):
      raise SecretError(f"{where} is not a regular file")
    if info.st_uid != os.geteuid():
      raise SecretError(f"{where} belongs to user id {info.st_uid}, not to you "
                        f"({os.geteuid()}); allowed: a file of yours, mode 0600")
    if info.st_mode & 0o077:
      raise SecretError(f"{where} has mode {stat.S_IMODE(info.st_mode):04o}; allowed: "
                        f"readable by its owner only (chmod 600 {path})")
    return parse_secret(f.read(), where)


def check_private_dir(path: str, what: str) -> None:
  """Makes ``path`` (mode 0700) or checks that it is a directory of this user's that no one else
  may write to (nor any symbolic link in its place): where the launcher puts a run secret and
  its children's logs. Raises SecretError naming ``what`` and the fix."""
  try:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    os.mkdir(path, 0o700)
  except FileExistsError:
    pass
  info = os.lstat(path)
  if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
    raise SecretError(f"{what} {path!r} is not a directory (a symbolic link or a file); "
                      "allowed: a directory of yours")
  if info.st_uid != os.geteuid():
    raise SecretError(f"{what} {path!r} belongs to user id {info.st_uid}, not to you "
                      f"({os.geteuid()}): someone else made it; allowed: a directory of yours "
                      "(choose another --workdir)")
  if info.st_mode & 0o022:
    raise SecretError(f"{what} {path!r} has mode {stat.S_IMODE(info.st_mode):04o}: others may "
                      f"replace its files; allowed: writable by you only (chmod go-w {path})")


def open_private_append(path: str):
  """``path`` opened to append (created mode 0600), refusing a symbolic link in its place."""
  try:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                 | getattr(os, "O_CLOEXEC", 0), 0o600)
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise SecretError(f"{path!r} is a symbolic link; allowed: a regular file (a log of the "
                        "run)") from None
    raise
  return os.fdopen(fd, "ab")


def write_secret_file(path: str, secret: str) -> None:
  """Writes ``secret`` to a new file ``path`` created with mode 0600 (never an existing file)."""
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with os.fdopen(fd, "w") as f:
    f.write(secret + "\n")


def load_secret(environ=None) -> bytes:
  """The run secret from ``GSSP_SECRET`` or ``GSSP_SECRET_FILE``; raises SecretError without one."""
  environ = os.environ if environ is None else environ
  if environ.get(SECRET_ENV):
    return parse_secret(environ[SECRET_ENV], SECRET_ENV)
  if environ.get(SECRET_FILE_ENV):
    return read_secret_file(os.path.expanduser(environ[SECRET_FILE_ENV]))
  raise SecretError(f"no run secret: set {SECRET_FILE_ENV} (a file of mode 0600) or {SECRET_ENV}"
                    f" to the same 64 hex characters on every host of the run. Make one: "
                    f"{MAKE_ONE}")


def new_run_id() -> str:
  """A fresh run id (64 random bits, hexadecimal): the one-host launcher's, one per launch."""
  return secrets.token_hex(8)


def check_run_id(run_id: str, source: str = RUN_ID_ENV) -> str:
  """``run_id`` if it is 1-64 characters of letters, digits, ``.``, ``_``, ``-``; else SecretError."""
  if not isinstance(run_id, str) or not 1 <= len(run_id) <= 64 or not set(run_id) <= RUN_ID_CHARS:
    raise SecretError(f"{source}={run_id!r} is invalid; allowed: 1-64 letters, digits, '.', '_' "
                      f"or '-', the same on every process of the run. Make one: {MAKE_RUN_ID}")
  return run_id


def load_run_id(environ=None) -> str:
  """The run id from ``GSSP_RUN_ID``; SecretError without one (it is not secret: it makes each
  run's token its own, so a token seen in one run opens no other)."""
  environ = os.environ if environ is None else environ
  if not environ.get(RUN_ID_ENV):
    raise SecretError(f"no run id: set {RUN_ID_ENV} to the same value on every process of this "
                      "run and a new one for each run (the one-host launcher makes one); the "
                      f"run's token is derived from it and the secret. Make one: {MAKE_RUN_ID}")
  return check_run_id(environ[RUN_ID_ENV])


def load_credentials(environ=None) -> "Credentials":
  """The run's credentials from the environment: its secret and its run id."""
  return Credentials(load_secret(environ), load_run_id(environ))


class Credentials:
  """What a process derives from the run secret and the run id: the call token, the receipt key.

  Both are HMACs of the secret over the run id (and a label), so a token or a
  receipt seen in one run is worthless in any other run, even one that shares
  the secret (one ``~/.gssp_secret`` for every run of a cluster).
  """

  def __init__(self, secret: bytes, run_id: str):
    if len(secret) * 2 != SECRET_HEX_CHARS:
      raise SecretError(f"a run secret has {SECRET_HEX_CHARS // 2} bytes, not {len(secret)}")
    self.run_id = check_run_id(run_id, "the run id")
    derive = lambda label: hmac.new(secret, label + b"|" + run_id.encode(),
                                    hashlib.sha256).digest()
    self.token = derive(b"gssp call token v2").hex()
    self._receipt_key = derive(b"gssp shard receipt v2")

  @property
  def metadata(self) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_KEY, self.token),)

  def receipt(self, shard: int, mesh: int, seq: int, session: str, nbytes: int,
              digest: bytes) -> bytes:
    """Shard ``shard`` staged push ``seq`` of ``mesh`` in ``session``: ``nbytes`` bytes whose
    SHA-256 is ``digest`` (``wire.digest``), so a receipt vouches for those bytes only."""
    message = f"{int(shard)}|{int(mesh)}|{int(seq)}|{session}|{int(nbytes)}|{digest.hex()}"
    return hmac.new(self._receipt_key, message.encode(), hashlib.sha256).digest()

  def check_receipt(self, receipt, shard: int, mesh: int, seq: int, session: str,
                    nbytes: int, digest: bytes) -> bool:
    return isinstance(receipt, bytes) and isinstance(digest, bytes) and hmac.compare_digest(
        receipt, self.receipt(shard, mesh, seq, session, nbytes, digest))


REFUSAL = ("this call lacks the run's token: the caller is not part of this run (set "
           f"{SECRET_FILE_ENV} or {SECRET_ENV} to the run's secret and {RUN_ID_ENV} to its "
           "run id)")


class TokenInterceptor(grpc.ServerInterceptor):
  """Refuses (``UNAUTHENTICATED``) every call without the run's token, before any handler runs.

  Refusals are logged at most once a minute per method, without the token a
  caller sent (it might be another run's secret). The Flight data plane's
  middleware (``runtime/flight.py``) asks the same object (:meth:`check`).
  """

  def __init__(self, credentials: Credentials):
    self._token = credentials.token.encode()
    self._logged: dict[str, float] = {}
    self._lock = threading.Lock()
    self.refused = 0

    def deny(request_iterator, context):
      del request_iterator   # never read: the refusal does not wait for the caller's message
      context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
      yield b""   # pragma: no cover (abort raises)
    # One streaming refusal for every method, unary ones too: grpcio reads a unary request
    # whole before its handler runs, so a unary refusal held a pool thread for as long as a
    # stranger took to send its message (or forever). A streaming handler runs at once and
    # aborts; the caller sees UNAUTHENTICATED whatever its method's kind.
    self._deny = grpc.stream_stream_rpc_method_handler(deny)

  def check(self, given, method: str) -> bool:
    """Whether ``given`` (str or bytes) is the run's token; counts and logs a refusal."""
    given = given.encode() if isinstance(given, str) else bytes(given)
    if hmac.compare_digest(given, self._token):
      return True
    with self._lock:
      self.refused += 1
      now = time.monotonic()
      if now - self._logged.get(method, -1e9) > 60.0:
        self._logged[method] = now
        logging.warning("refused a call to %s without the run's token (%d refused so far)",
                        method, self.refused)
    return False

  def intercept_service(self, continuation, handler_call_details):
    given = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_KEY, "")
    method = handler_call_details.method
    if self.check(given, method):
      return continuation(handler_call_details)
    return self._deny


# -- TLS (optional) ---------------------------------------------------------------------------


def _read(path: str, what: str) -> bytes:
  try:
    with open(os.path.expanduser(path), "rb") as f:
      return f.read()
  except OSError as e:
    raise ValueError(f"{what}={path!r} cannot be read ({e.strerror}); allowed: a PEM file") from None


def tls_enabled(dist) -> bool:
  return bool(dist.get("tls_cert", ""))


def server_credentials(dist) -> grpc.ServerCredentials | None:
  """TLS for a server from ``dist.tls_cert``/``tls_key`` (None: plain TCP); mTLS with
  ``dist.tls_client_auth``, clients' certificates checked against ``dist.tls_ca``.

  ``dist``: ``config.dist`` (or any mapping with those keys).
  """
  if not tls_enabled(dist):
    return None
  key = _read(dist["tls_key"], "config.dist.tls_key")
  cert = _read(dist["tls_cert"], "config.dist.tls_cert")
  client_auth = bool(dist.get("tls_client_auth", False))
  ca = _read(dist["tls_ca"], "config.dist.tls_ca") if client_auth else None
  return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                     require_client_auth=client_auth)


def channel_credentials(dist) -> grpc.ChannelCredentials | None:
  """TLS for a client: trusts ``dist.tls_ca``; presents ``tls_cert``/``tls_key`` for mTLS."""
  if not tls_enabled(dist):
    return None
  ca = _read(dist["tls_ca"], "config.dist.tls_ca")
  if dist.get("tls_client_auth", False):
    return grpc.ssl_channel_credentials(ca, _read(dist["tls_key"], "config.dist.tls_key"),
                                        _read(dist["tls_cert"], "config.dist.tls_cert"))
  return grpc.ssl_channel_credentials(ca)


def flight_server_tls(dist) -> dict | None:
  """TLS for the Flight data plane's server (``pyarrow.flight.FlightServerBase`` arguments)
  from the same files as :func:`server_credentials`; None: plain TCP."""
  if not tls_enabled(dist):
    return None
  from pyarrow import flight  # pylint: disable=g-import-not-at-top
  pair = flight.CertKeyPair(_read(dist["tls_cert"], "config.dist.tls_cert"),
                            _read(dist["tls_key"], "config.dist.tls_key"))
  client_auth = bool(dist.get("tls_client_auth", False))
  return {"tls_certificates": [pair], "verify_client": client_auth,
          "root_certificates": _read(dist["tls_ca"], "config.dist.tls_ca") if client_auth
                               else None}


def flight_client_tls(dist) -> dict | None:
  """TLS for a Flight client (``pyarrow.flight.FlightClient`` arguments), as
  :func:`channel_credentials`; None: plain TCP."""
  if not tls_enabled(dist):
    return None
  tls = {"tls_root_certs": _read(dist["tls_ca"], "config.dist.tls_ca")}
  if dist.get("tls_client_auth", False):
    tls.update(cert_chain=_read(dist["tls_cert"], "config.dist.tls_cert"),
               private_key=_read(dist["tls_key"], "config.dist.tls_key"))
  return tls
