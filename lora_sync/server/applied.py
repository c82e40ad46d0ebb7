"""A name's output is its adapter's: a request admission labels with adapter names must reach
the engine carrying exactly those adapters.

Routes are not listed anywhere. Each engine's seam reports, for every request it is about to
hand the engine, the adapters that request carries (`engine_request`: vLLM's
AsyncLLM.add_request, SGLang's TokenizerManager.generate_request). A route that dropped or
replaced the adapter on the way (one that does not read the field the name came in, or
rewrites it after admission, or a route added in a later engine release) is refused there,
before the engine computes anything: deny by default, by construction. Admission turns the
refusal into a 400 `route_ignores_adapter` naming the route."""
from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from ..errors import BadRequest


@dataclass
class Expected:
    """What one HTTP request was admitted with: `names` as the engine knows them (served
    names of ours, the engine's own adapters by name); `refused`: the refusal, once made."""
    route: str
    names: frozenset[str]
    refused: BadRequest | None = None
    ran: bool = False  # an engine request carried them

    def refusal(self, start: dict) -> BadRequest | None:
        """At the reply's start: the refusal to send instead, if any. A successful reply
        that is not a stream must have run the engine on the adapters (a stream's engine
        requests start after its first bytes); one that did not (tokenization, a route
        answering from elsewhere) did not compute with them."""
        if self.refused is None and not self.ran and 200 <= start["status"] < 300 \
                and not _is_stream(start):
            self.refused = _refuse(self, "nothing")
        return self.refused


_EXPECTED: ContextVar[Expected | None] = ContextVar("lora_sync_expected", default=None)


def expect(expected: Expected):
    """Sets what the requests handled in this context must carry; returns the reset token.
    Tasks the route starts inherit it (a copy of the context, the same Expected)."""
    return _EXPECTED.set(expected)


def done(token) -> None:
    _EXPECTED.reset(token)


def engine_request(adapters) -> None:
    """Called by an engine seam for each request it hands the engine, with the adapter name
    each of its prompts carries (None: the base model). Outside an admitted request (no
    adapter named), anything goes; inside one, the request must carry exactly the admitted
    adapters, or it is refused (BadRequest, recorded for admission's reply)."""
    expected = _EXPECTED.get()
    if expected is None:
        return
    carried = set(adapters)
    if carried == expected.names:
        expected.ran = True
        return
    expected.refused = _refuse(expected, ", ".join(
        sorted("the base model" if a is None else repr(a) for a in carried)))
    raise expected.refused


def _refuse(expected: Expected, served: str) -> BadRequest:
    return BadRequest(
        f"route {expected.route[:100]} does not apply the adapter this request names "
        f"({', '.join(sorted(expected.names))}): the engine would have served {served} "
        "under that name. Name the adapter where this route reads it, or use a route that "
        "applies it (/v1/completions, /v1/chat/completions)", code="route_ignores_adapter")


def _is_stream(start: dict) -> bool:
    return any(k.lower() == b"content-type" and v.lower().startswith(b"text/event-stream")
               for k, v in start.get("headers", []))
