"""Secure mesh: CURVE keys, the allow-list of public certificates, roles.

Every node has a key pair in pyzmq's certificate format (``NAME.key`` public,
``NAME.key_secret`` secret); the certificate's metadata names the node's role
(tower, store, producer, consumer, gateway).  A directory of public
certificates (the allow-list) decides who may join and which role each key
has: a node's role is what the allow-list says, never what the node claims.

Bound sockets are CURVE servers; pyzmq's :class:`ThreadAuthenticator` (one per
process and allow-list) answers ZAP with that directory and reloads it when it
changes.  Connecting sockets are CURVE clients and need the server's public
key: towers' keys come from the configuration, peers' keys from the beacons
(which the towers check against the ZAP User-Id of the sender).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from dafka.errors import ConfigError, ProtocolError

log = logging.getLogger("dafka.security")

ROLES = ("tower", "store", "producer", "consumer", "gateway")
# Roles whose ACKs, DIRECT-HEADs and STORE-HELLOs are honoured: they persist records.
STORING_ROLES = frozenset({"store", "gateway"})
KEY_LENGTH = 40  # a Z85-encoded CURVE public key


@dataclass(frozen=True, slots=True)
class Certificate:
    """One certificate file: Z85 keys (secret only in a secret certificate) and metadata."""

    path: Path
    public: bytes
    secret: bytes | None
    metadata: dict[str, str]

    @property
    def role(self) -> str:
        return self.metadata.get("role", "")

    @property
    def name(self) -> str:
        return self.path.name.split(".key")[0]


def read_certificate(path: str | os.PathLike[str]) -> Certificate:
    """Read a pyzmq certificate file, keys and metadata (ValueError if unusable)."""
    path = Path(path)
    try:
        public, secret = zmq.auth.load_certificate(path)
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ValueError(f"cannot read certificate {path}: {exc}") from exc
    if len(public) != KEY_LENGTH or (secret is not None and len(secret) != KEY_LENGTH):
        raise ValueError(f"certificate {path} has no valid CURVE key")
    metadata: dict[str, str] = {}
    section = ""
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            section = line.strip()
        elif section == "metadata" and "=" in line:
            key, value = line.split("=", 1)
            metadata[key.strip()] = value.strip().strip("'\"")
    return Certificate(path, public, secret, metadata)


def new_keys(name: str, role: str, directory: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Create ``NAME.key`` and ``NAME.key_secret`` in ``directory``, both naming ``role``."""
    if role not in ROLES:
        raise ConfigError(f"role must be one of {', '.join(ROLES)}")
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"bad key name {name!r}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    public, secret = out / f"{name}.key", out / f"{name}.key_secret"
    if public.exists() or secret.exists():
        raise ConfigError(f"{public} or {secret} already exists")
    # Made in a private directory (0700) and moved into place once 0600: the
    # secret is never readable by others, not even for a moment.
    work = Path(tempfile.mkdtemp(prefix=".new-key-", dir=out))
    try:
        zmq.auth.create_certificates(work, name, metadata={"role": f'"{role}"'})
        os.chmod(work / secret.name, 0o600)
        # pyzmq writes metadata into the secret certificate only; the public one
        # (the one that goes into allow-lists) must carry the role as well.
        text = (work / public.name).read_text(encoding="utf-8")
        (work / public.name).write_text(
            text.replace("metadata\n", f'metadata\n    role = "{role}"\n', 1), encoding="utf-8"
        )
        os.replace(work / secret.name, secret)
        os.replace(work / public.name, public)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return public, secret


def private_secret(path: str | os.PathLike[str]) -> None:
    """Make a secret certificate readable by its owner only (0600), saying so if it was not."""
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o077:
        log.warning("%s was readable by others (mode %o): made 0600", path, mode)
        os.chmod(path, 0o600)


def list_certificates(directory: str | os.PathLike[str]) -> list[Certificate]:
    """The certificates (public and secret) in ``directory``, by name."""
    out = []
    for path in sorted(Path(directory).glob("*.key*")):
        if path.suffix in (".key", ".key_secret"):
            try:
                out.append(read_certificate(path))
            except ValueError as exc:
                log.warning("%s", exc)
    return out


def load_allow_list(directory: str | os.PathLike[str]) -> dict[bytes, str]:
    """Public key (Z85) -> role of every ``*.key`` certificate in ``directory``."""
    roles: dict[bytes, str] = {}
    for path in sorted(Path(directory).glob("*.key")):
        try:
            cert = read_certificate(path)
        except ValueError as exc:
            log.warning("allow-list: %s", exc)
            continue
        if cert.role not in ROLES:
            log.warning("allow-list: %s has no known role (%r); not allowed", path, cert.role)
            continue
        roles[cert.public] = cert.role
    return roles


def parse_key(text: str) -> bytes:
    """A public key given as Z85 text or as the path of a certificate file."""
    text = text.strip()
    if len(text) == KEY_LENGTH and not os.path.exists(text):
        return text.encode()
    try:
        return read_certificate(text).public
    except ValueError as exc:
        raise ConfigError(f"{text!r} is neither a 40-character public key nor a certificate: {exc}") from None


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """The ``[security]`` table: own secret certificate, allow-list, tower keys."""

    key: str  # path of this node's secret certificate (NAME.key_secret)
    allow: str  # directory of allowed public certificates
    tower_keys: tuple[bytes, ...] = ()  # one for every tower, or one shared by all
    reload_interval: float = 1.0
    leaf_keys: tuple[bytes, ...] = ()  # a leaf's endpoints' keys: one for every endpoint, or one shared by all

    def tower_key(self, index: int) -> bytes:
        if not self.tower_keys:
            raise ConfigError("secure mode needs the towers' public keys ([security] tower_keys / --tower-key)")
        return self.tower_keys[index if len(self.tower_keys) > 1 else 0]

    def leaf_key(self, index: int) -> bytes:
        """The public key of a leaf's endpoint ``index`` (the store it dials)."""
        if not self.leaf_keys:
            raise ConfigError("a secure leaf needs its endpoints' public keys ([security] leaf_keys / --leaf-key)")
        return self.leaf_keys[index if len(self.leaf_keys) > 1 else 0]


def security_from(data: dict[str, object], flags: dict[str, object] | None = None) -> SecurityConfig | None:
    """A SecurityConfig from a ``[security]`` table overridden by flags; None: plain mode."""
    merged = {k: v for k, v in data.items()}
    for k, v in (flags or {}).items():
        if v:
            merged[k] = v
    unknown = set(merged) - {"key", "allow", "tower_keys", "reload_interval", "leaf_keys"}
    if unknown:
        raise ConfigError(f"unknown [security] keys: {', '.join(sorted(unknown))}")
    if not merged.get("key") and not merged.get("allow"):
        if merged.get("tower_keys"):
            raise ConfigError("tower keys are given but no key and allow-list: secure mode needs all three")
        return None
    if not merged.get("key") or not merged.get("allow"):
        raise ConfigError("secure mode needs both a key ([security] key / --key) and an allow-list (allow / --allow)")
    keys = merged.get("tower_keys") or ()
    if isinstance(keys, str):
        keys = [k for k in keys.split(",") if k.strip()]
    tower_keys = tuple(parse_key(str(k)) for k in keys)  # type: ignore[union-attr]
    leaves = merged.get("leaf_keys") or ()
    if isinstance(leaves, str):
        leaves = [k for k in leaves.split(",") if k.strip()]
    leaf_keys = tuple(parse_key(str(k)) for k in leaves)  # type: ignore[union-attr]
    if not Path(str(merged["allow"])).is_dir():
        raise ConfigError(f"allow-list directory {merged['allow']} does not exist")
    return SecurityConfig(
        str(merged["key"]), str(merged["allow"]), tower_keys, float(merged.get("reload_interval", 1.0)),  # type: ignore[arg-type]
        leaf_keys,
    )


class Guard:
    """The ZAP authenticator and allow-list of one process (per allow-list directory).

    Secure nodes use the guard's own ZeroMQ context (ZAP is per context), so
    plain nodes in the same process are unaffected.  :meth:`refresh` reloads
    the directory when it changed; ``version`` counts the reloads.

    ZAP (pyzmq's authenticator) asks :meth:`callback`, so it allows exactly
    the keys the nodes themselves accept: a certificate with a known role.
    (``configure_curve(location=...)`` would keep its whole previous list
    when one file in the directory is unreadable, and ignores roles.)
    """

    def __init__(self, allow: str) -> None:
        self.allow = allow
        self.ctx = zmq.Context()
        # Secure nodes read each peer on a socket of its own (and watch it for
        # refused handshakes): lift ZeroMQ's default cap of 1023 sockets a context
        # (it must be set before the first socket).
        self.ctx.set(zmq.MAX_SOCKETS, self.ctx.get(zmq.SOCKET_LIMIT))
        self.auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("dafka.auth"))
        self.auth.start()
        self.auth.configure_curve_callback("*", self)
        self._lock = threading.Lock()
        self._signature: object = None
        self.roles: dict[bytes, str] = {}
        self.version = 0
        self.refresh(force=True)

    def _dir_signature(self) -> object:
        try:
            return sorted((e.name, e.stat().st_mtime_ns, e.stat().st_size) for e in os.scandir(self.allow))
        except OSError:
            return None

    def refresh(self, force: bool = False) -> bool:
        """Reload the allow-list if it changed; True when it did."""
        with self._lock:
            signature = self._dir_signature()
            if signature == self._signature and not force:
                return False
            self._signature = signature
            if signature is None:
                log.error("allow-list directory %s is unreadable; keeping the previous list", self.allow)
                return False
            roles = load_allow_list(self.allow)
            if roles != self.roles or force:
                if not force:
                    log.info("allow-list %s reloaded: %d keys", self.allow, len(roles))
                self.roles = roles
                self.version += 1
                return True
            return False

    def role(self, key: bytes) -> str | None:
        return self.roles.get(key)

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP's question (in the authenticator's thread): is this Z85 client key allowed?"""
        return key in self.roles


_guards: dict[str, Guard] = {}
_guards_lock = threading.Lock()


def guard_for(config: SecurityConfig) -> Guard:
    """The process's guard of ``config.allow`` (created on first use)."""
    path = os.path.realpath(config.allow)
    with _guards_lock:
        guard = _guards.get(path)
        if guard is None:
            guard = _guards[path] = Guard(path)
        return guard


@dataclass(frozen=True, slots=True)
class OwnKeys:
    public: bytes
    secret: bytes
    role: str


def own_keys(config: SecurityConfig) -> OwnKeys:
    """This node's key pair, from its secret certificate."""
    try:
        cert = read_certificate(config.key)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cert.secret is None:
        raise ConfigError(f"{config.key} is a public certificate; the node needs its .key_secret file")
    return OwnKeys(cert.public, cert.secret, cert.role)


def make_server(sock: zmq.Socket, keys: OwnKeys) -> None:
    """A bound socket: CURVE server, clients checked by ZAP against the allow-list."""
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SERVER, 1)


def make_client(sock: zmq.Socket, keys: OwnKeys) -> None:
    """A connecting socket: CURVE client (set the server key before each connect)."""
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)


def connect(sock: zmq.Socket, endpoint: str, server_key: bytes) -> None:
    """Connect a CURVE client to a server whose public key is ``server_key``.

    The key is copied into the connection when it is made, so one socket can
    connect to many servers with different keys.
    """
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
    sock.connect(endpoint)


class Retries:
    """Connections to make again later: ZeroMQ gives a refused handshake up for good,
    and the peer's allow-list may have us by then."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self._waiting: list[tuple[float, zmq.Socket, str]] = []

    def add(self, sock: zmq.Socket, endpoint: str, now: float) -> None:
        self._waiting.append((now + self.delay, sock, endpoint))

    def take_due(self, now: float) -> list[tuple[zmq.Socket, str]]:
        """The (socket, endpoint) pairs due by ``now``, no longer waiting."""
        due = [(sock, endpoint) for when, sock, endpoint in self._waiting if when <= now]
        if due:
            self._waiting = [r for r in self._waiting if r[0] > now]
        return due


def reconnect(sock: zmq.Socket, endpoint: str, server_key: bytes, logger: logging.Logger) -> None:
    """Connect again after a refused handshake (ZeroMQ gives such a connection up)."""
    try:
        sock.disconnect(endpoint)
    except zmq.ZMQError:
        pass  # already given up by ZeroMQ
    try:
        connect(sock, endpoint, server_key)
    except zmq.ZMQError as exc:
        logger.debug("could not reconnect to %s: %s", endpoint, exc)


_REFUSALS = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


_MONITOR_IDS = itertools.count(1)


class RefusalLog:
    """Logs the handshakes a secure socket refused (unknown key, plain peer).

    Reads the socket's monitor; the owner polls :attr:`monitor` and calls
    :meth:`read`.  Logging is rate-limited like bad input.  On a connecting
    socket, ``on_refused(endpoint)`` is called: ZeroMQ does not reconnect
    after a refused handshake, so the owner retries later itself (the peer's
    allow-list may have us by then).
    """

    def __init__(
        self,
        sock: zmq.Socket,
        what: str,
        logger: logging.Logger,
        on_refused: Callable[[str], None] | None = None,
        events: int = 0,
        on_event: Callable[[int, str], None] | None = None,
        refusals: bool = True,
    ) -> None:
        """``events``: more monitor events to pass to ``on_event(event, endpoint)``
        (one monitor per socket: ZeroMQ allows no second one); ``refusals=False``:
        those only (a plain socket: a connection closed before its handshake is no refusal)."""
        self.what = what
        self.on_event = on_event
        self.client = on_refused is not None
        self.on_refused = on_refused
        self.log = logger
        self.count = 0
        self.sock = sock
        # A unique inproc name: pyzmq's default names it after the socket's
        # FD, and a closed socket's monitor endpoint is released by libzmq's
        # reaper later, so a new socket that got the same FD could collide.
        mask = (_REFUSALS if refusals else 0) | events
        self.monitor = sock.get_monitor_socket(mask, f"inproc://dafka-refusals-{next(_MONITOR_IDS)}")

    def read(self) -> None:
        for _ in range(1000):
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                event = parse_monitor_message(frames)
            except Exception:
                continue
            if not event["event"] & _REFUSALS:
                if self.on_event is not None:
                    self.on_event(event["event"], event["endpoint"].decode(errors="replace"))
                continue
            self.count += 1
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                why = "our key is not in its allow-list" if self.client else "the peer's key is not in the allow-list"
            elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                why = "the peer does not speak CURVE (a plain node or tower?) or the handshake was malformed"
            else:
                why = "the handshake failed: a plain (non-CURVE) peer, or a wrong key"
            endpoint = event["endpoint"].decode(errors="replace")
            if self.count <= 20 or self.count % 1000 == 0:
                self.log.warning(
                    "secure %s: handshake on %s refused: %s; %d refused so far",
                    self.what,
                    endpoint,
                    why,
                    self.count,
                )
            if self.on_refused is not None:
                self.on_refused(endpoint)

    def close(self) -> None:
        # libzmq's monitor stop sends a last event and blocks while the monitor's
        # queue (1,000 events) is full: a node with hundreds of peers that went
        # away queues that many reconnect attempts within a second once its loop
        # stopped reading.  Empty it first (bounded), then stop it.
        for _ in range(100_000):
            try:
                self.monitor.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                break
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass  # the socket is already closed
        self.monitor.close(0)


# ---------------------------------------------------------------- key-bound addresses
# In secure mode a node's address is bound to its public key: the first 16 hex
# characters are a random nonce, the last 16 a hash of the key and the nonce.
# Anyone who knows the key can check the binding (towers before relaying a
# beacon, nodes before believing a RECORD or HEAD), nobody can make an address
# bound to another key, and one key may own many addresses (producers sharing
# a key file, one partition each).  It is still 32 uppercase hex characters.

_ADDRESS_DOMAIN = b"dafka key-bound address v1\x00"
_NONCE = 16  # hex characters of the nonce; the rest of the 32 are the tag


def _address_tag(key: bytes, nonce: str) -> str:
    return hashlib.sha256(_ADDRESS_DOMAIN + key + nonce.encode()).hexdigest()[: 32 - _NONCE].upper()


def bound_address(key: bytes) -> str:
    """A new node address bound to the Z85 public ``key``."""
    nonce = os.urandom(_NONCE // 2).hex().upper()
    return nonce + _address_tag(key, nonce)


def address_bound(address: str, key: bytes) -> bool:
    """Whether ``address`` was made by :func:`bound_address` for ``key``."""
    if len(address) != 32:
        return False
    return hmac.compare_digest(address[_NONCE:].encode(), _address_tag(key, address[:_NONCE]).encode())


# ---------------------------------------------------------------- secure beacons
# Plain beacons stay exactly as the C reference sends them; a secure beacon
# appends one frame, the sender's Z85 public key.


def secure_node_beacon(beacon: list[bytes], key: bytes) -> list[bytes]:
    """A node beacon (``wire.node_beacon``) with the node's public key as a 5th frame."""
    return [*beacon, key]


def split_key(frames: list[bytes], plain_length: int, what: str) -> tuple[list[bytes], bytes]:
    """(plain frames, key) of a secure beacon; ProtocolError when it carries no key."""
    if len(frames) != plain_length + 1 or len(frames[-1]) != KEY_LENGTH:
        raise ProtocolError(f"secure {what} must be {plain_length + 1} frames ending with a public key")
    return frames[:-1], bytes(frames[-1])
