"""CURVE on a tcp endpoint (kvd.endpoint rule 6), or the operator's explicit opt-out.

ZAP runs in zmq.auth's ThreadAuthenticator: a thread of its own with a
socket on the daemon's context, answering libzmq's handshake questions from
the public keys in `authorized/` (read at start: restart to admit a new
client). It keeps the serving loop single-threaded and one request at a
time, and it is pyzmq's own tested ZAP handler, not one of ours.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import zmq

from kvd.endpoint import EndpointError, authorized_dir, server_keys

log = logging.getLogger("kvd.server")


def secure_tcp(ctx: zmq.Context, sock: zmq.Socket, endpoint: str, keys_dir: Path, allow_insecure: bool,
               security: dict[str, Any]) -> Any:
    """Make `sock` a CURVE server with the keys in `keys_dir`, and start the
    authenticator (returned, for the daemon to stop); None when serving
    unauthenticated as the operator asked. `security` gets what `kvd stats`
    shows of it. Raises EndpointError when there are no keys and no opt-out."""
    keys = server_keys(keys_dir)
    if keys is None:
        if not allow_insecure:
            raise EndpointError(
                f"refusing to serve {endpoint} without CURVE keys: any host that reaches the port could "
                f"read and write every cache. Run `kvd keys init` and `kvd keys add-client NAME` (keys dir "
                f"{keys_dir}), or set allow_insecure_tcp = true to serve it unauthenticated"
            )
        warning = f"serving {endpoint} WITHOUT authentication (allow_insecure_tcp): any peer that reaches it reads and writes every namespace"
        log.warning("%s", warning)
        security.update(curve=False, warning=warning)
        return None
    from zmq.auth.thread import ThreadAuthenticator

    allowed = authorized_dir(keys_dir)
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvd.server.zap"))
    auth.start()
    auth.configure_curve(domain="*", location=str(allowed))
    sock.curve_server = True
    sock.curve_publickey, sock.curve_secretkey = keys.public, keys.secret
    security.update(curve=True, authorized_clients=len(list(allowed.glob("*.key"))))
    log.info("tcp with CURVE: %d authorized client keys in %s", security["authorized_clients"], allowed)
    return auth
