"""Close the Tinker SDK clients a test module made once the module is done.

A ``ServiceClient`` (and ``twinkle_client``, built on it) keeps its session alive with a heartbeat
task on the SDK's own event-loop thread until the client is closed. A test's server stops when
the test or module does; a client left open goes on sending heartbeats to the closed port, and
two minutes later the SDK logs "Session heartbeat failed ... Tinker is down" every ten seconds,
to the end of the pytest run and past it. ``closing_module_clients`` (a module-scoped autouse
fixture of the conftests that need it) records every client holder the SDK makes while the
module runs and closes them after its last test: closing a holder is local (it cancels the
heartbeat and the pollers and closes its connection pools), so it is safe after the server is
gone, and no test of the module can still be using the client."""

import weakref

_made: list[weakref.ref] = []
_recording = False


def _record() -> None:
    """Wrap the SDK's client holder's constructor (once) to note each holder made."""
    global _recording
    if _recording:
        return
    try:
        from tinker.lib.internal_client_holder import InternalClientHolder
    except ImportError:  # no SDK installed: no client to close
        return

    made = InternalClientHolder.__init__

    def recorded(self, *args, **kwargs):
        made(self, *args, **kwargs)
        _made.append(weakref.ref(self))

    InternalClientHolder.__init__ = recorded
    _recording = True


def close_made_since(mark: int) -> None:
    """Close every holder made since ``len(_made)`` was ``mark`` that is still alive."""
    for ref in _made[mark:]:
        holder = ref()
        if holder is not None:
            holder.close()
    del _made[mark:]


def closing_module_clients():
    """The body of a module-scoped autouse fixture: yields, then closes the module's clients."""
    _record()
    mark = len(_made)
    yield
    close_made_since(mark)
