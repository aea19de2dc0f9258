"""A generative tenant: an OpenAI-compatible ``/v1/completions`` endpoint driven with
``stream: true`` (server-sent events), timed per token.

- time to first token (TTFT): from the request's scheduled arrival to the first event that
  carries text (so queueing counts, as for request latency);
- time per output token (TPOT): (last token − first token) / (tokens − 1), tokens being the
  server's ``usage.completion_tokens`` when it sends one, else the text events counted.

The prompt is copies of a common word (one token each in GPT-style tokenizers, four in a
byte-level one), as many as make ``prompt_tokens`` tokens by the server's own count
(``fit_prompt``); ``max_tokens`` bounds the output. aiohttp comes in through the session given.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

from gpulens.errors import RuntimeFailure

PATH = "/v1/completions"
PROMPT_WORD = " the"


@dataclass
class StreamTiming:
    """One streamed completion: times from ``time.perf_counter``; NaN where none came."""

    status: int
    first_token_s: float = math.nan
    last_token_s: float = math.nan
    tokens: int = 0


def completion_body(model: str, prompt_tokens: int, max_tokens: int) -> bytes:
    body = {
        "model": model,
        "prompt": PROMPT_WORD * prompt_tokens,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def parse_event(line: bytes) -> dict | None:
    """One SSE line -> its JSON payload; None for comments, blank lines and ``[DONE]``."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == b"[DONE]":
        return None
    try:
        obj = json.loads(payload)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def event_text(obj: dict) -> str:
    choices = obj.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    first = choices[0]
    return first.get("text") or (first.get("delta") or {}).get("content") or ""


async def stream_completion(session, url: str, body: bytes, timeout) -> StreamTiming:
    """POST one streamed completion and time its tokens (errors raise as aiohttp's do)."""
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    async with session.post(url + PATH, data=body, headers=headers, timeout=timeout) as resp:
        if resp.status != 200:
            await resp.read()
            return StreamTiming(resp.status)
        timing = StreamTiming(resp.status)
        events, usage = 0, None
        async for line in resp.content:
            if line.strip() == b"data: [DONE]":
                break
            obj = parse_event(line)
            if obj is None:
                continue
            if event_text(obj):
                now = time.perf_counter()
                if events == 0:
                    timing.first_token_s = now
                timing.last_token_s = now
                events += 1
            tokens = (obj.get("usage") or {}).get("completion_tokens")
            if isinstance(tokens, int):
                usage = tokens
        timing.tokens = usage if usage is not None else events
        return timing


def time_per_output_token_s(timing: StreamTiming) -> float:
    if timing.tokens < 2 or math.isnan(timing.first_token_s):
        return math.nan
    return (timing.last_token_s - timing.first_token_s) / (timing.tokens - 1)


def _error_message(raw: bytes) -> str:
    """The server's words from an error body: OpenAI's ``{"error": {"message"}}``, a plain
    ``{"error": "..."}`` or the text itself, on one short line."""
    try:
        obj = json.loads(raw)
    except ValueError:
        obj = None
    err = obj.get("error") if isinstance(obj, dict) else None
    text = err.get("message") if isinstance(err, dict) else err
    text = str(text) if text else raw.decode("utf-8", "replace")
    return " ".join(text.split())[:300]


def _prompt_tokens_counted(raw: bytes) -> int | None:
    """The server's ``usage.prompt_tokens`` from a streamed (or plain JSON) answer, if any."""
    for line in raw.splitlines() or [raw]:
        obj = parse_event(line) if line.strip().startswith(b"data:") else None
        if obj is None:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
        tokens = (obj.get("usage") or {}).get("prompt_tokens") if isinstance(obj, dict) else None
        if isinstance(tokens, int):
            return tokens
    return None


async def preflight(session, aiohttp, url: str, model: str, body: bytes, timeout) -> int | None:
    """One completion as the run will send it, before the schedule: a 4xx (a model the server
    does not serve, a prompt plus max_tokens over its context) is the command's mistake, said
    in one line, not a run whose every request is an error. Returns the prompt tokens the
    server counted (``usage.prompt_tokens``), None when it says not."""
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    try:
        async with session.post(url + PATH, data=body, headers=headers, timeout=timeout) as r:
            raw, status = await r.read(), r.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise RuntimeFailure(
            f"cannot reach {url}{PATH} ({type(exc).__name__}: {exc}); start the server (e.g. "
            "gpulens serve --model gpt) or fix --url"
        ) from None
    if 400 <= status < 500:
        raise RuntimeFailure(
            f"POST {url}{PATH} for {model!r} returned HTTP {status} ({_error_message(raw)}): "
            "check the model name (--openai, --tenant), --prompt-tokens and --max-tokens"
        )
    return _prompt_tokens_counted(raw) if 200 <= status < 300 else None


async def fit_prompt(session, aiohttp, url: str, model: str, prompt_tokens: int,
                     max_tokens: int, timeout) -> tuple[bytes, int, int | None]:  # fmt: skip
    """The request body whose prompt the SERVER counts as ``prompt_tokens`` tokens: the word
    is one token in GPT-style tokenizers but four in a byte-level one (gpulens's own gpt), so
    two one-token probes of 8 and 16 words measure the server's tokens per word (and any fixed
    tokens it adds), and the word count follows. The body is then checked as it will be sent.
    Returns (body, words, prompt tokens the server counted or None)."""
    words = prompt_tokens
    a = await preflight(session, aiohttp, url, model, completion_body(model, 8, 1), timeout)
    b = await preflight(session, aiohttp, url, model, completion_body(model, 16, 1), timeout)
    if a is not None and b is not None and b > a:
        per_word = (b - a) / 8.0
        words = max(1, round((prompt_tokens - (a - 8 * per_word)) / per_word))
    body = completion_body(model, words, max_tokens)
    counted = await preflight(session, aiohttp, url, model, body, timeout)
    return body, words, counted
