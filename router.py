# router.py — the request router in front of the engines.
#
# Owns: which engine serves a request, and what happens when an engine fails.
#   - Sticky by session: a session (a rollout's id) keeps going to the engine that served its last turn, which
#     holds its prefix in cache. The assignment is remembered (an LRU dict), not hashed, so the sessions of an
#     engine taken out move to a live one.
#   - Otherwise least outstanding tokens: the live engine with the fewest tokens requested (max_tokens) and not
#     yet sampled, so a batch of long replies weighs more than a batch of short ones.
#   - Each engine's share of a call runs on its own thread: engines sample at the same time.
#   - Tokens are streamed from an engine only when the caller listens (`on_token`: loopback's streaming, an agent
#     that streams): per-step outputs cost throughput (vLLM switches from each request's final output to a delta
#     every step: 10-15% fewer tokens/s on an H200, `bench/gpu.py --parts vllm_speed`). A call not streamed holds its max_tokens as outstanding until it answers.
#   - Failover: an engine whose generate fails with an engine-level error (anything but a ValueError, which is
#     the request's own bad input and goes back to the caller as it is) is probed and, if broken, taken out of
#     rotation; so is a hung engine: a streamed call that samples no token for `timeout_s`, or a call not streamed
#     that has no answer for `timeout_s` and whose engine then fails a probe (an engine that answers the probe
#     still samples, and the call waits another `timeout_s`). Its requests are retried once on another live
#     engine, or counted as lost and raised to the caller (EngineFailure). A request is never dropped silently.
#   - The control plane (pause, weight update, resume) fans out to the live engines, in that order, so no
#     engine samples with weights older than the version it reports (invariant 2); an engine taken out rejoins
#     only after loading the current weights. An engine that fails a control call (a checkpoint's sampler_state
#     too) is taken out and the call goes on for the others: an engine that died with no request in flight is
#     still marked live, and the first call to reach it must not end the run.
# Never: changes a request or a result, or reads an engine's internals: an engine is anything with the engine
# calls (generate, check, check_images, update_weights, pause, resume, sampler_state, load_sampler_state, version),
# in this process or a proxy to another one.
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from engines import Generation, SamplingParams, per_prompt
from invariants import ImageInput

log = logging.getLogger("tracerl.router")

# A health check after an engine-level error: one greedy token from a one-token prompt (id 0 is in every
# vocabulary; the seed keeps the engine's own random stream untouched, so a probe never shifts later samples).
PROBE_PROMPT, PROBE_PARAMS = [0], SamplingParams(top_k=1, max_tokens=1, seed=0)


# ---- records ----------------------------------------------------------------------------------------------

class EngineFailure(RuntimeError):
    """Requests no live engine could serve: their engine failed and the retry failed too, or no live engine was
    left to retry on. Never the request's fault (that is a ValueError)."""


@dataclass
class EngineStats:
    """One engine's counters as the router saw them, since the router was built (`Router.stats()`)."""
    live: bool = True                  # in rotation
    down_reason: str = ""              # why it was taken out ("" while live)
    in_flight: int = 0                 # requests sent and not yet answered
    outstanding_tokens: int = 0        # over those: max_tokens requested minus tokens already streamed
    tokens: int = 0                    # tokens sampled
    busy_s: float = 0.0                # seconds with at least one request in flight
    served: int = 0                    # requests answered
    retried: int = 0                   # of those, requests another engine had failed first
    failed: int = 0                    # requests this engine failed (an engine-level error or a timeout)

    @property
    def tokens_per_s(self) -> float:
        """Sampling speed while the engine had work (idle time does not dilute it)."""
        return self.tokens / self.busy_s if self.busy_s > 0 else 0.0


@dataclass
class _Call:
    """One engine.generate call in flight: some of a caller's requests, sent to one engine as one batch."""
    engine: int
    indices: list[int]                 # each row's index in the caller's request list
    reserved: int                      # sum of the rows' max_tokens (outstanding until streamed, or answered)
    last_sign: float                   # Router._active_time() at the start, at the latest token (streamed), or
                                       # when the engine last answered a probe (not streamed)
    streaming: bool                    # the engine hears each token (the caller passed on_token)
    produced: int = 0                  # tokens streamed so far, all rows
    streamed: set[int] = field(default_factory=set)   # requests whose caller's on_token has heard a token
    result: list[Generation] | None = None
    error: Exception | None = None
    caller_error: Exception | None = None   # raised by the caller's own on_token: goes back to the caller
    timed_out: bool = False            # hung (see Router._wait): the router stopped waiting
    closed: bool = False               # answered or given up on: a late token is refused, never relayed
    done: threading.Event = field(default_factory=threading.Event)


# ---- the router -------------------------------------------------------------------------------------------

class Router:
    """Same interface as an engine (`generate`, `check`, `check_images`, `update_weights`, `pause`, `resume`,
    `sampler_state`, `load_sampler_state`, `version`, `max_model_len`), over several. `generate` also takes `session_ids`.
    `timeout_s`: how long a streamed request may go without sampling a token (its first one included) before it
    counts as hung; a request not streamed, whose tokens the router cannot see, counts as hung when it has no
    answer for `timeout_s` and its engine then fails a probe. Time paused for a weight update does not count.
    `max_sessions`: sticky assignments remembered (least recently used forgotten first; a forgotten session is
    placed again by load)."""

    def __init__(self, engines: list, timeout_s: float = 300.0, max_sessions: int = 65536):
        if not engines:
            raise ValueError("a Router needs at least one engine")
        self.engines = engines
        self.timeout_s, self.max_sessions = timeout_s, max_sessions
        self._stats = [EngineStats() for _ in engines]
        self._busy_since: list[float | None] = [None] * len(engines)
        self._sessions: OrderedDict[str, int] = OrderedDict()   # session id -> engine, least recent first
        self._held = [0] * len(engines)                           # sticky sessions per engine
        self.lost = 0                                             # requests raised to callers as EngineFailure
        self._lock = threading.Lock()           # guards the counters, the sessions and liveness
        self._control = threading.RLock()       # one control-plane operation at a time
        self._paused_s, self._paused_at = 0.0, None   # total seconds paused, and the current pause's start

    @property
    def version(self) -> int:
        return min(self.engines[e].version for e in self._live())

    @property
    def max_model_len(self) -> int:
        """The most positions (prompt + reply) every engine serves."""
        return min(engine.max_model_len for engine in self.engines)

    def stats(self) -> list[EngineStats]:
        """A snapshot of every engine's counters, in engine order."""
        now = time.monotonic()
        with self._lock:
            return [replace(s, busy_s=s.busy_s + (now - since if since is not None else 0.0))
                    for s, since in zip(self._stats, self._busy_since)]

    def metrics(self) -> dict[str, float]:
        """The counters as a step's metrics, under perf/ (they count from process start, so a resumed run's
        differ from the uninterrupted run's)."""
        stats = self.stats()
        m = {"perf/engines_live": float(sum(s.live for s in stats)), "perf/requests_lost_total": float(self.lost)}
        for e, s in enumerate(stats):
            m.update({f"perf/engine{e}/tokens_per_s": s.tokens_per_s,
                      f"perf/engine{e}/outstanding_tokens": float(s.outstanding_tokens),
                      f"perf/engine{e}/served_total": float(s.served),
                      f"perf/engine{e}/retried_total": float(s.retried),
                      f"perf/engine{e}/failed_total": float(s.failed)})
        return m

    # -- the data plane --

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 on_token: Callable[[int, int], None] | None = None,
                 session_ids: list[str | None] | None = None,
                 images: list[Sequence[ImageInput]] | None = None) -> list[Generation]:
        """Place every request (sticky by `session_ids[i]`, else least outstanding tokens), run each engine's share
        as one batch on its own thread, and return the results in request order (`on_token` is called with the
        request's own index; without it the engines stream nothing and answer with final outputs only). Requests
        of a failed engine are retried once elsewhere; a request whose tokens already reached `on_token` is not
        (the listener would hear a second reply), nor is one no engine is left for: those raise EngineFailure. A
        ValueError, or an error of `on_token` itself, is raised as it is."""
        params_list, images = per_prompt(len(prompts), params, images)
        sessions = session_ids if session_ids is not None else [None] * len(prompts)
        if len(sessions) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sessions)} session ids; pass one per prompt "
                             f"(None for a request without a session)")
        results: list[Generation | None] = [None] * len(prompts)
        why: dict[int, str] = {}                        # request -> why its last attempt failed
        tried: list[set[int]] = [set() for _ in prompts]   # engines that failed each request
        pending = list(range(len(prompts)))
        for retry in (False, True):
            calls = self._place(pending, sessions, params_list, tried, why, on_token is not None)
            wake = threading.Event()
            for call in calls:
                self._launch(call, prompts, params_list, images, on_token, wake)
            self._wait(calls, wake)
            pending, caller_errors = [], []
            for call in calls:
                again, caller_error = self._settle(call, retry, results, tried, why)
                pending += again
                caller_errors += [caller_error] if caller_error is not None else []
            if caller_errors:
                raise caller_errors[0]
            if not pending:
                break
        lost = [i for i, r in enumerate(results) if r is None]
        if lost:
            with self._lock:
                self.lost += len(lost)
            raise EngineFailure(f"{len(lost)} of {len(prompts)} requests could not be served; request {lost[0]}: "
                                f"{why[lost[0]]}. Engines: {self._describe()}")
        return results

    def _settle(self, call: _Call, retry: bool, results: list[Generation | None], tried: list[set[int]],
                why: dict[int, str]) -> tuple[list[int], Exception | None]:
        """Book a finished (or timed-out) call: its results into `results`, or, if its engine failed, the requests
        to retry. Returns (requests to retry, the caller's own error if the call raised one)."""
        self._close(call)
        if not call.timed_out and call.result is not None:
            for i, gen in zip(call.indices, call.result):
                results[i] = gen
            with self._lock:
                self._stats[call.engine].served += len(call.indices)
                self._stats[call.engine].retried += len(call.indices) if retry else 0
            return [], None
        if not call.timed_out and (call.caller_error is not None or isinstance(call.error, ValueError)):
            return [], call.caller_error or call.error
        reason, again = self._engine_failed(call), []
        for i in call.indices:
            tried[i].add(call.engine)
            why[i] = f"{why[i]}; retried, then {reason}" if i in why else reason
            if i in call.streamed:
                why[i] += " (its tokens had already reached the caller's listener: not replayed)"
            else:
                again.append(i)
        return again, None

    def _place(self, pending: list[int], sessions: list[str | None], params_list: list[SamplingParams],
               tried: list[set[int]], why: dict[int, str], streaming: bool) -> list[_Call]:
        """Assign each pending request an engine it has not failed on, reserving its max_tokens there at once (so
        the next request of the same call sees the load); group them into one call per engine."""
        calls: dict[int, _Call] = {}
        with self._lock:
            for i in pending:
                engine = self._pick(sessions[i], tried[i])
                if engine is None:
                    why[i] = (why[i] + "; no other live engine to retry on") if i in why else "no live engine"
                    continue
                if engine not in calls:
                    calls[engine] = _Call(engine, [], 0, self._active_time(), streaming)
                calls[engine].indices.append(i)
                calls[engine].reserved += params_list[i].max_tokens
                self._reserve(engine, params_list[i].max_tokens)
        return list(calls.values())

    def _reserve(self, engine: int, max_tokens: int) -> None:
        """Count one more request in flight on `engine`. Caller holds _lock."""
        self._stats[engine].outstanding_tokens += max_tokens
        self._stats[engine].in_flight += 1
        if self._busy_since[engine] is None:
            self._busy_since[engine] = time.monotonic()

    def _pick(self, session: str | None, exclude: set[int]) -> int | None:
        """The session's engine if it is live; otherwise the live engine with the fewest outstanding tokens (ties:
        the one holding fewer sessions, then the lower index), remembered for the session. Caller holds _lock."""
        live = [e for e, s in enumerate(self._stats) if s.live and e not in exclude]
        if not live:
            return None
        if session is not None and self._sessions.get(session) in live:
            self._sessions.move_to_end(session)
            return self._sessions[session]
        chosen = min(live, key=lambda e: (self._stats[e].outstanding_tokens, self._held[e], e))
        if session is not None:
            if session in self._sessions:
                self._held[self._sessions[session]] -= 1
            self._sessions[session] = chosen
            self._sessions.move_to_end(session)
            self._held[chosen] += 1
            while len(self._sessions) > self.max_sessions:
                self._held[self._sessions.popitem(last=False)[1]] -= 1
        return chosen

    def _launch(self, call: _Call, prompts: list[list[int]], params_list: list[SamplingParams],
                images: list[list[ImageInput]], on_token: Callable[[int, int], None] | None,
                wake: threading.Event) -> None:
        """Run the call's rows as one engine.generate on a thread of its own (a daemon: a hung engine must not
        keep the process alive). Every token of a streamed call passes through `relay`, which keeps the load
        counters and the timeout clock, and refuses tokens of a call the router has given up on; a call not
        streamed gives the engine no listener, and its tokens are counted when it answers."""
        stats = self._stats[call.engine]

        def relay(row: int, token_id: int) -> None:
            with self._lock:
                if call.closed:
                    raise RuntimeError(f"engine {call.engine}: the router gave up on this request")
                call.produced += 1
                call.last_sign = self._active_time()
                stats.tokens += 1
                stats.outstanding_tokens -= 1
            if on_token is not None:
                call.streamed.add(call.indices[row])
                try:
                    on_token(call.indices[row], token_id)
                except Exception as error:
                    call.caller_error = error
                    raise

        def serve() -> None:
            try:
                result = self.engines[call.engine].generate(
                    [prompts[i] for i in call.indices], [params_list[i] for i in call.indices],
                    relay if call.streaming else None, images=[images[i] for i in call.indices])
                with self._lock:
                    if not (call.streaming or call.closed):   # as a late token, a late answer is not counted
                        stats.tokens += sum(len(g.token_ids) for g in result)
                call.result = result
            except Exception as error:
                call.error = error
            finally:
                call.done.set()
                wake.set()
        threading.Thread(target=serve, name=f"router-engine-{call.engine}", daemon=True).start()

    def _wait(self, calls: list[_Call], wake: threading.Event) -> None:
        """Until every call has answered or is hung: `timeout_s` of unpaused time without a sign of life. A
        streamed call's sign is a token. A call not streamed shows none until it answers, so then its engine is
        probed: if the probe answers, the engine still samples and the call's clock starts again; if not, the
        call is hung. (Probes run one at a time, so a hung engine's probe can hold the other calls' checks back by
        up to `timeout_s`.)"""
        while True:
            wake.clear()                         # cleared before looking, so an answer in between is not missed
            for call in calls:
                if call.done.is_set() or call.timed_out or self._active_time() - call.last_sign < self.timeout_s:
                    continue
                if call.streaming or not self._healthy(call.engine):
                    call.timed_out = not call.done.is_set()
                else:
                    call.last_sign = self._active_time()
            waiting = [c for c in calls if not (c.done.is_set() or c.timed_out)]
            if not waiting:
                return
            now = self._active_time()
            wake.wait(max(min(self.timeout_s - (now - c.last_sign) for c in waiting), 0.01))

    def _close(self, call: _Call) -> None:
        """Release the call's reservation and, if it was the engine's last, end its busy time."""
        with self._lock:
            call.closed = True
            stats = self._stats[call.engine]
            stats.outstanding_tokens -= max(call.reserved - call.produced, 0)
            stats.in_flight -= len(call.indices)
            if stats.in_flight == 0 and self._busy_since[call.engine] is not None:
                stats.busy_s += time.monotonic() - self._busy_since[call.engine]
                self._busy_since[call.engine] = None

    def _engine_failed(self, call: _Call) -> str:
        """Count the call's requests as failed on its engine and take the engine out if it is hung, or if it fails
        a probe (an error a healthy engine raises, e.g. one row's bad ids, leaves it in rotation). Returns why."""
        with self._lock:
            self._stats[call.engine].failed += len(call.indices)
        if call.timed_out:
            reason = (f"engine {call.engine} sampled no token for {self.timeout_s:g} s" if call.streaming else
                      f"engine {call.engine} answered nothing for {self.timeout_s:g} s and failed a probe")
            self._take_out(call.engine, reason)
            return reason
        reason = f"engine {call.engine} failed: {type(call.error).__name__}: {call.error}"
        log.warning("router: %s (%d requests)", reason, len(call.indices))
        if not self._healthy(call.engine):
            self._take_out(call.engine, reason)
        return reason

    def _healthy(self, engine: int) -> bool:
        """Does the engine still sample? One probe request, under the same timeout. The probe is streamed, so
        its own clock gives up on it (one token: streaming it costs nothing, and a probe is never probed)."""
        with self._lock:
            self._reserve(engine, PROBE_PARAMS.max_tokens)
            probe = _Call(engine, [0], PROBE_PARAMS.max_tokens, self._active_time(), streaming=True)
        wake = threading.Event()
        self._launch(probe, [PROBE_PROMPT], [PROBE_PARAMS], [[]], None, wake)
        self._wait([probe], wake)
        self._close(probe)
        return not probe.timed_out and probe.result is not None

    def _take_out(self, engine: int, reason: str) -> None:
        with self._lock:
            if not self._stats[engine].live:
                return
            self._stats[engine].live, self._stats[engine].down_reason = False, reason
            left = sum(s.live for s in self._stats)
        log.error("router: engine %d taken out of rotation (%s); %d of %d engines live",
                  engine, reason, left, len(self.engines))

    def _live(self) -> list[int]:
        """The live engines' indices; EngineFailure if there are none."""
        live = [e for e, s in enumerate(self._stats) if s.live]
        if not live:
            raise EngineFailure(f"no live engine: {self._describe()}")
        return live

    def _describe(self) -> str:
        return "; ".join(f"engine {e} " + ("live" if s.live else f"out ({s.down_reason})")
                         for e, s in enumerate(self._stats))

    def _active_time(self) -> float:
        """Monotonic seconds minus the seconds paused: a request's timeout does not run while the engines are
        paused for a weight update. Read under _lock where it is stored (a read racing resume() can only come out
        early, which makes a call look less idle, never more)."""
        now = time.monotonic()
        return now - self._paused_s - (now - self._paused_at if self._paused_at is not None else 0.0)

    # -- the control plane: live engines only --

    def check(self, params: SamplingParams) -> None:
        for e in self._live():
            self._fan_out(e, "check", params)

    def check_images(self, prompt: list[int], images: Sequence[ImageInput]) -> None:
        for e in self._live():
            self._fan_out(e, "check_images", prompt, images)

    def pause(self) -> None:
        with self._control:
            with self._lock:
                if self._paused_at is None:
                    self._paused_at = time.monotonic()
            for e, s in enumerate(self._stats):
                if s.live:
                    self._fan_out(e, "pause")

    def resume(self) -> None:
        with self._control:
            for e, s in enumerate(self._stats):
                if s.live:
                    self._fan_out(e, "resume")
            with self._lock:
                if self._paused_at is not None:
                    self._paused_s += time.monotonic() - self._paused_at
                    self._paused_at = None

    def update_weights(self, state: dict, version: int) -> None:
        """Pause all, load on all, resume all (live engines): tokens after the resume carry `version` on every
        engine. The requests in flight go by each engine's `drain_on_update`: a dense model's engine keeps them
        paused across its load (a request that spans it reads [v]*n1 + [v+1]*n2), an MoE model's admits no new one
        and loads once they have finished at the old version (each request has one version). An engine whose load
        fails with an engine-level error is taken out (it would serve old weights); a ValueError (the state does not
        fit the model) is raised. Resume happens even if a load fails (a leaked pause hangs the run)."""
        with self._control:
            self.pause()
            try:
                for e in self._live():
                    self._fan_out(e, "update_weights", state, version)
                self._live()                     # weights that reached no engine are an error, not a silent no-op
            finally:
                self.resume()

    def rejoin(self, engine: int, state: dict, version: int) -> None:
        """Put an engine that was taken out back in rotation, after it has loaded the live engines' weights
        (`state` at `version`, which must be theirs, if any engine is live), paused or running as the others are."""
        with self._control:
            if self._stats[engine].live:
                raise ValueError(f"engine {engine} is live; only an engine taken out can rejoin")
            if any(s.live for s in self._stats) and version != self.version:
                raise ValueError(f"engine {engine} would rejoin at version {version} but the live engines are at "
                                 f"{self.version}; pass their current weights")
            self.engines[engine].update_weights(state, version)
            if self._paused_at is not None:
                self.engines[engine].pause()
            else:
                self.engines[engine].resume()       # it may have been taken out while paused
            with self._lock:
                self._stats[engine].live, self._stats[engine].down_reason = True, ""
        log.warning("router: engine %d rejoined at version %d", engine, version)

    def sampler_state(self) -> list:
        """Every live engine's random stream, in engine order, saved with a checkpoint for an exact resume; None
        for an engine taken out, and for one that fails to answer now (it is taken out: an engine that died since
        its last request is still marked live, and a checkpoint must not fail for it; `stats()` says why)."""
        return [self._fan_out(e, "sampler_state") if s.live else None for e, s in enumerate(self._stats)]

    def load_sampler_state(self, states: list) -> None:
        """Restore each live engine's stream from `states` (sampler_state's list); an engine whose entry is None
        keeps the stream it started with. One that fails to load is taken out, as in any control call."""
        if len(states) != len(self.engines):
            raise ValueError(f"sampler states of {len(states)} engines for a router of {len(self.engines)}; resume "
                             f"with the engine count the checkpoint was written with")
        for e, state in enumerate(states):
            if state is not None and self._stats[e].live:
                self._fan_out(e, "load_sampler_state", state)

    def _fan_out(self, engine: int, call: str, *args):
        """One control call on one engine; returns its answer. A ValueError is the caller's (raised); any other
        error means the engine is broken: it is taken out, the others go on, and the answer is None."""
        try:
            return getattr(self.engines[engine], call)(*args)
        except ValueError:
            raise
        except Exception as error:
            self._take_out(engine, f"{call} failed: {type(error).__name__}: {error}")
            return None
