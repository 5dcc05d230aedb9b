"""Who serves which model, by Redis's clock (never a process's own, which may be skewed): each
pool child's heartbeat per model it has loaded (tasks.keys.live_key), each worker's consuming
heartbeat (CONSUMING_KEY, and consuming_key per queue it consumes), and the models a worker
says must not count as live for a while (unhealthy_key: its children crash-loop, or a batch
runs past its time limit). Workers write
them (workers/child/runtime.py, workers/batching/liveness.py); the API reads them for /readyz and
/v1/models (app/store.py)."""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from tasks.keys import CONSUMING_KEY, consuming_key, live_key, unhealthy_key
from tasks.lua import script

# Redis's clock, then: a heartbeat or an unhealthy mark (tasks/lua/presence_stamp.lua), and who
# serves each model (presence_live.lua).
_STAMP = script("presence_stamp")
_LIVE = script("presence_live")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Presence:
    """The heartbeats over one Redis client."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._stamp = client.register_script(_STAMP)
        self._live = client.register_script(_LIVE)

    def beat(self, keys: Iterable[str], member: str, keep_s: float) -> None:
        """`member` is live now in each of these sets; entries older than `keep_s` go."""
        keys = list(keys)
        if keys:
            self._stamp(keys=keys, args=[member, keep_s, 0])

    def consuming(self, worker: str, queues: Iterable[str], dropped: Iterable[str],
                  keep_s: float) -> None:
        """`worker` consumes `queues` now, and no longer `dropped` (`cancel_consumer`)."""
        queues = list(queues)
        if queues:
            self.beat([CONSUMING_KEY, *map(consuming_key, queues)], worker, keep_s)
        dropped = list(dropped)
        if dropped:
            with self._client.pipeline(transaction=False) as pipe:
                for queue in dropped:
                    pipe.zrem(consuming_key(queue), worker)
                pipe.execute()

    def unhealthy(self, models: Iterable[str], worker: str, for_s: float) -> None:
        """The worker's instances of these models do not count as live for `for_s`."""
        keys = [unhealthy_key(m) for m in models]
        if keys:
            self._stamp(keys=keys, args=[worker, for_s, for_s])

    def live(self, queues: Mapping[str, str], ttl_s: float) -> dict[str, dict]:
        """Per model (`queues`: model -> its queue), its live instances (pool children with it
        loaded whose heartbeat is younger than `ttl_s`, in workers that consume its queue and
        have not marked it unhealthy), the workers they are in, and the instances
        (`members`: `hostname/index`)."""
        names = list(queues)
        keys = []
        for name in names:
            keys += [consuming_key(queues[name]), live_key(name), unhealthy_key(name)]
        found = self._live(keys=keys, args=[ttl_s]) if keys else []
        out = {}
        for i, name in enumerate(names):
            consuming, children, sick = found[3 * i:3 * i + 3]
            workers = {_text(w) for w in consuming} - {_text(w) for w in sick}
            serving = [m for m in map(_text, children) if m.rsplit("/", 1)[0] in workers]
            out[name] = {"workers": len({m.rsplit("/", 1)[0] for m in serving}),
                         "instances": len(serving), "members": serving}
        return out
