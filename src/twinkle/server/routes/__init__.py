"""The HTTP routes, one module per family of the Tinker SDK, each an ``APIRouter`` of
module-level handlers that reach the app's state through ``requests.server_of``:

- ``clients``: health, client configuration, SDK clients (``ServiceClient``);
- ``training``: training runs, ``forward_backward``, ``optim_step``, the runs' listing;
- ``checkpoints``: saving and loading a run's weights, the checkpoints' listing, delete, TTL;
- ``sampling``: samplers and ``asample``;
- ``futures``: polling and cancelling a queued request's future;
- ``metrics``: ``/metrics`` for the operator, ``/api/v1/usage`` for a tenant;
- ``unsupported``: the SDK's routes this server lacks, each a one-line 404.

``ROUTERS`` is the order ``create_app`` adds their routes in. A new route goes in its family's
module; a new family is a module here and its router in ``ROUTERS``."""

from twinkle.server.routes import checkpoints, clients, futures, metrics, sampling, training, unsupported

ROUTERS = (
    clients.router,
    training.router,
    checkpoints.router,
    sampling.router,
    futures.router,
    metrics.router,
    unsupported.router,  # last: a 405 for a path one of these shares names the served route's methods
)

__all__ = ["ROUTERS"]
