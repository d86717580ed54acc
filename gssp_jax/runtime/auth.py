"""Who may call a real run's servers: mutual TLS keyed by a per-run secret, a token on every call,
receipts.

Every process of a run holds the same **run secret**: 256 random bits, written
as 64 hexadecimal characters, handed over by the environment
(``GSSP_SECRET``) or by a file only its owner can read (``GSSP_SECRET_FILE``,
mode 0600, as ssh keys). The one-host launcher makes a fresh one per run; on
a cluster the user makes one file and points every host at it::

  umask 077; python -c "import secrets; print(secrets.token_hex(32))" > ~/.gssp_secret
  export GSSP_SECRET_FILE=~/.gssp_secret

The secret itself never travels and is never logged, nor written to
``summary.json`` or ``config.json``. From it and the **run id**
(``GSSP_RUN_ID``, the same on every process of a run, a new one per run; not
secret; the one-host launcher makes one) every process derives:

* the run's **TLS** key and certificate (:func:`run_tls_pem`; ``dist.tls_mode='run'``, the
  default), which each process presents and the only one it trusts, on gRPC and on Flight.
  Only holders of the secret complete a handshake: a caller without it gets no byte of a call
  read, and a listener in a server's place (a squatter) gets the client's TLS hello and
  nothing more, since the client checks the server's certificate before it sends its own,
  its token or a call. ``dist.tls_mode='files'`` uses the user's PEM files instead (mutual
  with ``dist.tls_client_auth``), ``'none'`` plain TCP;
* the call **token** (``Credentials.token``), checked by a server interceptor
  (:class:`TokenInterceptor`) in constant time before any handler runs, so a token seen in
  one run opens no other;
* the **receipt** key: a shard acknowledges the gradient slice it staged with an HMAC of
  (shard, mesh, push number, session, size, the slice's SHA-256); the control plane applies a
  push only when the mesh hands it a valid receipt from every other shard for the digests the
  mesh computed of its own slices, and tells each shard which digest to apply, so no shard is
  ever asked to apply a gradient it did not receive and check, nor one that another caller
  staged under the mesh's number.

Everything here is the standard library's ``hmac``/``secrets``, gRPC's own
credentials and the ``cryptography`` package's keys and certificates: no
cryptography is written by hand.
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
from typing import Any

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
    self._run_tls = lambda: run_tls_pem(secret, run_id)
    self._run_tls_pems = None

  def run_tls(self) -> tuple[bytes, bytes]:
    """The run's TLS key and certificate, PEM (:func:`run_tls_pem`), made once."""
    if self._run_tls_pems is None:
      self._run_tls_pems = self._run_tls()
    return self._run_tls_pems

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


# -- TLS: the run's own (default), the user's PEM files, or none -------------------------------

RUN_TLS_NAME = "gssp-run"     # the name in the run's certificate; clients check it
TLS_MODES = ("run", "files", "none")
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


def run_tls_pem(secret: bytes, run_id: str) -> tuple[bytes, bytes]:
  """The run's TLS key and certificate (PEM), derived from the secret and the run id.

  Every process of the run derives the same P-256 key (from an HMAC of the
  secret) and the same self-signed certificate, byte for byte (fixed fields, a
  deterministic ECDSA signature, RFC 6979), which is both the identity each
  process presents and the one root each trusts. Whoever completes a handshake
  with it holds the run's secret and run id: a server proves it before a
  client sends anything but its TLS hello, and a client proves it before a
  server reads a byte of its calls. The key and the certificate are made with
  the ``cryptography`` package; nothing here is written by hand but the fields.
  """
  from cryptography import x509  # pylint: disable=g-import-not-at-top
  from cryptography.hazmat.primitives import hashes  # pylint: disable=g-import-not-at-top
  from cryptography.hazmat.primitives import serialization  # pylint: disable=g-import-not-at-top
  from cryptography.hazmat.primitives.asymmetric import ec  # pylint: disable=g-import-not-at-top
  from cryptography.x509 import oid  # pylint: disable=g-import-not-at-top
  derive = lambda label: hmac.new(secret, label + b"|" + run_id.encode(), hashlib.sha512).digest()
  scalar = int.from_bytes(derive(b"gssp run tls key v1"), "big") % (_P256_ORDER - 1) + 1
  key = ec.derive_private_key(scalar, ec.SECP256R1())
  name = x509.Name([x509.NameAttribute(oid.NameOID.COMMON_NAME, f"gssp run {run_id}")])
  usage = x509.ExtendedKeyUsage([oid.ExtendedKeyUsageOID.SERVER_AUTH,
                                 oid.ExtendedKeyUsageOID.CLIENT_AUTH])
  certificate = (
      x509.CertificateBuilder().subject_name(name).issuer_name(name)
      .public_key(key.public_key())
      .serial_number(int.from_bytes(derive(b"gssp run tls serial v1")[:16], "big") >> 1)
      .not_valid_before(_utc(2020)).not_valid_after(_utc(2120))
      .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
      .add_extension(x509.SubjectAlternativeName([x509.DNSName(RUN_TLS_NAME)]), critical=False)
      .add_extension(usage, critical=False)
      .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
      .sign(key, hashes.SHA256(), ecdsa_deterministic=True))
  key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption())
  return key_pem, certificate.public_bytes(serialization.Encoding.PEM)


def _utc(year: int):
  import datetime  # pylint: disable=g-import-not-at-top
  return datetime.datetime(year, 1, 1, tzinfo=datetime.timezone.utc)


def tls_mode(dist) -> str:
  """``dist.tls_mode`` (``'run'`` where a mapping lacks it, as the defaults have it)."""
  mode = dist.get("tls_mode", "run")
  if mode not in TLS_MODES:
    raise ValueError(f"config.dist.tls_mode={mode!r} is invalid; allowed: "
                     + ", ".join(map(repr, TLS_MODES)))
  return mode


def _read(path: str, what: str) -> bytes:
  try:
    with open(os.path.expanduser(path), "rb") as f:
      return f.read()
  except OSError as e:
    raise ValueError(f"{what}={path!r} cannot be read ({e.strerror}); allowed: a PEM file") from None


def _pems(dist, credentials: Credentials) -> dict[str, Any] | None:
  """The PEM bytes of this process's TLS (``key``, ``cert``, ``ca`` and ``client_auth``); None
  with ``tls_mode='none'``."""
  mode = tls_mode(dist)
  if mode == "none":
    return None
  if mode == "run":
    key, cert = credentials.run_tls()
    return {"key": key, "cert": cert, "ca": cert, "client_auth": True}
  return {"key": _read(dist["tls_key"], "config.dist.tls_key") if dist["tls_key"] else b"",
          "cert": _read(dist["tls_cert"], "config.dist.tls_cert"),
          "ca": _read(dist["tls_ca"], "config.dist.tls_ca"),
          "client_auth": bool(dist.get("tls_client_auth", False))}


def server_name(dist) -> str:
  """The name a client checks in servers' certificates ('' : the address's host)."""
  return RUN_TLS_NAME if tls_mode(dist) == "run" else dist.get("tls_server_name", "")


def server_credentials(dist, credentials: Credentials) -> grpc.ServerCredentials | None:
  """A server's TLS (None: plain TCP): the run's own, mutual (``tls_mode='run'``), or the
  user's files (``'files'``), mutual with ``dist.tls_client_auth``.

  ``dist``: ``config.dist`` (or any mapping with its keys).
  """
  pems = _pems(dist, credentials)
  if pems is None:
    return None
  return grpc.ssl_server_credentials(
      [(pems["key"], pems["cert"])], root_certificates=pems["ca"] if pems["client_auth"] else None,
      require_client_auth=pems["client_auth"])


def channel_credentials(dist, credentials: Credentials) -> grpc.ChannelCredentials | None:
  """A client's TLS: trusts the CA (the run's certificate with ``'run'``), presents this
  process's certificate where servers require one."""
  pems = _pems(dist, credentials)
  if pems is None:
    return None
  if pems["client_auth"]:
    return grpc.ssl_channel_credentials(pems["ca"], pems["key"] or None, pems["cert"])
  return grpc.ssl_channel_credentials(pems["ca"])


def flight_server_tls(dist, credentials: Credentials) -> dict | None:
  """TLS for the Flight data plane's server (``pyarrow.flight.FlightServerBase`` arguments),
  as :func:`server_credentials`; None: plain TCP."""
  pems = _pems(dist, credentials)
  if pems is None:
    return None
  from pyarrow import flight  # pylint: disable=g-import-not-at-top
  return {"tls_certificates": [flight.CertKeyPair(pems["cert"], pems["key"])],
          "verify_client": pems["client_auth"],
          "root_certificates": pems["ca"] if pems["client_auth"] else None}


def flight_client_tls(dist, credentials: Credentials) -> dict | None:
  """TLS for a Flight client (``pyarrow.flight.FlightClient`` arguments), as
  :func:`channel_credentials`; None: plain TCP."""
  pems = _pems(dist, credentials)
  if pems is None:
    return None
  tls = {"tls_root_certs": pems["ca"]}
  if pems["client_auth"]:
    tls.update(cert_chain=pems["cert"], private_key=pems["key"])
  return tls
