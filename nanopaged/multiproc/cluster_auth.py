"""Who belongs to a cluster: the cluster secret, the CURVE keys derived from it, and the
addresses each node listens on (docs/trust.md).

Every zmq socket between hosts is CURVE (libzmq's CurveZMQ: authenticated and
encrypted) with one key pair that every node derives from the secret by HMAC-SHA256;
node 0's sockets are servers whose ZAP handler (pyzmq's ThreadAuthenticator) lets in
only clients presenting that key. A peer without the secret fails the handshake before
any of its bytes reach the engine. Nothing here invents cryptography: hmac, secrets and
libzmq's CURVE do the work.
"""
from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import os
import secrets
import socket
import stat
import struct
import tempfile

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

logger = logging.getLogger(__name__)

SECRET_ENV = "NANOPAGED_CLUSTER_SECRET"
MIN_SECRET_BYTES = 16
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


# -- the cluster secret and what it keys -------------------------------------------------------

def cluster_secret(config, announce=print) -> bytes:
    """The secret every node of this cluster holds: config.parallel_config.cluster_secret_file's
    content, else $NANOPAGED_CLUSTER_SECRET; node 0 without either writes a new one
    (secrets.token_hex) to a 0600 file and announces that file's path, never the secret.

    Raises:
        ValueError: a file that cannot be read, that others may read (chmod 600), or a
            secret under MIN_SECRET_BYTES; a node other than 0 with no secret.
    """
    path = config.parallel_config.cluster_secret_file
    if path is None and os.environ.get(SECRET_ENV):
        return _checked(os.environ[SECRET_ENV].strip().encode(), SECRET_ENV)
    if path is None and config.parallel_config.node_rank != 0:
        raise ValueError(f"node {config.parallel_config.node_rank} needs node 0's cluster secret: give --cluster-secret-file FILE "
                         f"(node 0 prints where it wrote one) or set {SECRET_ENV}")
    if path is None:
        folder = os.path.join(os.path.expanduser("~"), ".cache", "nanopaged")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="cluster-secret-", dir=folder)     # mode 0600
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        announce(f"nanopaged: no cluster secret was given; node 0 wrote a new one to {path} (mode 0600). Copy "
                 f"that file to every other node and start each with --cluster-secret-file FILE (or "
                 f"{SECRET_ENV} set to its content).")
    where = f"cluster_secret_file={str(path)!r}"
    try:
        mode = os.stat(path).st_mode
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as e:
        raise ValueError(f"{where}: cannot read it ({e.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{where}: other users may read it (mode {stat.S_IMODE(mode):04o}): chmod 600 it")
    return _checked(secret, where)


def _checked(secret: bytes, where: str) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{where}: the cluster secret has {len(secret)} bytes; give at least {MIN_SECRET_BYTES} "
                         f"(e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    return secret


def curve_keys(secret: bytes) -> tuple[bytes, bytes]:
    """The cluster's CURVE key pair (public, secret; Z85), derived from the secret by
    HMAC-SHA256: every node computes the same pair, and no one without the secret can."""
    secret_key = z85.encode(hmac.new(secret, b"nanopaged cluster curve key", hashlib.sha256).digest())
    return zmq.curve_public(secret_key), secret_key


class ClusterAuth:
    """CURVE on the zmq sockets of one context: `serve` makes a socket a server that
    lets in only clients holding the cluster's key (a ZAP handler checks it),
    `connect_to` a client that talks only to such a server. pyzmq's authenticator:
    zmq.auth.thread.ThreadAuthenticator."""

    def __init__(self, ctx: zmq.Context, secret: bytes) -> None:
        self.ctx = ctx
        self.public, self.secret = curve_keys(secret)
        self._authenticator: ThreadAuthenticator | None = None

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: a client that opened CURVE with the cluster's server key (so it knows the
        secret) must also present the cluster's own public key."""
        if key == self.public:
            return True
        logger.warning("refused a client on %s: its CURVE key is not this cluster's", domain)
        return False

    def serve(self, sock: zmq.Socket, port_name: str) -> None:
        if self._authenticator is None:
            self._authenticator = ThreadAuthenticator(self.ctx, log=logging.getLogger("nanopaged.zap"))
            self._authenticator.start()
        self._authenticator.configure_curve_callback(port_name, credentials_provider=self)
        sock.zap_domain = port_name.encode()
        sock.curve_secretkey, sock.curve_publickey = self.secret, self.public
        sock.curve_server = True

    def connect_to(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = self.secret, self.public, self.public

    def stop(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()


def interface_of(ip: str) -> str:
    """The name of the network interface that holds IPv4 address ip (for gloo, which
    binds an interface by name: GLOO_SOCKET_IFNAME).

    Raises:
        ValueError: no interface of this host holds ip.
    """
    packed = socket.inet_aton(socket.gethostbyname(ip))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                addr = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))   # SIOCGIFADDR
            except OSError:                 # an interface without an IPv4 address
                continue
            if addr[20:24] == packed:
                return name
    raise ValueError(f"no network interface of this host has the address {ip}: give --node-ip (or "
                     f"--master-addr on node 0) an address of this host")


def own_address(master_addr: str, master_port: int) -> str:
    """This host's address on the route to node 0 (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(master_addr), master_port))
        return s.getsockname()[0]
