# router.py — the request router in front of the engines.
#
# Owns: which engine serves a request (sticky by session, so a multi-turn rollout keeps its prefix cache
# on one engine; otherwise the least-loaded one) and the fan-out of the control plane (pause, weight
# update, resume) to every engine, in that order, so no engine ever samples with weights older than the
# version it reports (invariant 2).
# Never: changes a request or a result; it only chooses where a request goes.
from __future__ import annotations

import threading
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence

from invariants import ImageInput
from rollout import Generation, SamplingParams, images_per_prompt, params_per_prompt


class Router:
    """Same interface as an engine (`generate`, `check`, `check_images`, `update_weights`, `pause`, `resume`),
    over several."""

    def __init__(self, engines: list):
        if not engines:
            raise ValueError("a Router needs at least one engine")
        self.engines = engines
        self.in_flight = [0] * len(engines)        # requests being served, per engine
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        return min(e.version for e in self.engines)

    def pick(self, session_id: str | None) -> int:
        """Sticky: a session always maps to the same engine (crc32, stable across processes).
        Without a session: the engine with the fewest requests in flight."""
        if session_id is not None:
            return zlib.crc32(session_id.encode()) % len(self.engines)
        return min(range(len(self.engines)), key=self.in_flight.__getitem__)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 on_token: Callable[[int, int], None] | None = None,
                 session_ids: list[str | None] | None = None,
                 images: list[Sequence[ImageInput]] | None = None) -> list[Generation]:
        """Group the requests by engine, run each group as one batch, return results in request order
        (`on_token` is called with the request's own index; `images[i]` go with prompt i)."""
        params_list = params_per_prompt(params, len(prompts))
        images = images_per_prompt(images, len(prompts))
        session_ids = session_ids or [None] * len(prompts)
        groups: dict[int, list[int]] = defaultdict(list)
        with self._lock:
            for i, session in enumerate(session_ids):
                chosen = self.pick(session)
                groups[chosen].append(i)
                self.in_flight[chosen] += 1
        results: list[Generation | None] = [None] * len(prompts)
        try:
            for engine_index, indices in groups.items():
                relay = None if on_token is None else \
                    (lambda row, token_id, indices=indices: on_token(indices[row], token_id))
                outs = self.engines[engine_index].generate([prompts[i] for i in indices],
                                                           [params_list[i] for i in indices], relay,
                                                           images=[images[i] for i in indices])
                for i, out in zip(indices, outs):
                    results[i] = out
        finally:
            with self._lock:
                for engine_index, indices in groups.items():
                    self.in_flight[engine_index] -= len(indices)
        return results

    def check(self, params: SamplingParams) -> None:
        for e in self.engines:
            e.check(params)

    def check_images(self, prompt: list[int], images: Sequence[ImageInput]) -> None:
        for e in self.engines:
            e.check_images(prompt, images)

    def pause(self) -> None:
        for e in self.engines:
            e.pause()

    def resume(self) -> None:
        for e in self.engines:
            e.resume()

    def sampler_state(self) -> list:
        """Every engine's random stream, in engine order (saved with a checkpoint for an exact resume)."""
        return [e.sampler_state() for e in self.engines]

    def load_sampler_state(self, states: list) -> None:
        if len(states) != len(self.engines):
            raise ValueError(f"sampler states of {len(states)} engines for a router of {len(self.engines)}; resume "
                             f"with the engine count the checkpoint was written with")
        for e, state in zip(self.engines, states):
            e.load_sampler_state(state)

    def update_weights(self, state: dict, version: int) -> None:
        """Pause all, load on all, resume all: requests are kept, and tokens after the resume carry
        `version` on every engine. Resume happens even if a load fails (a leaked pause hangs the run)."""
        self.pause()
        try:
            for e in self.engines:
                e.update_weights(state, version)
        finally:
            self.resume()
