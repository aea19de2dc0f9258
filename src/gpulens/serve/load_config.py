"""What ``gpulens load`` was asked to do: tenants, their rates and SLOs, the run's length.

A tenant is written ``MODEL:rate=R[:slo_ms=S][:arrival=poisson|constant][:batch=B]``; commas
between the options work too (``MODEL:rate=R,slo_ms=S``, as ``gpulens colocate serve:`` jobs
are written), and ``arrivals=`` is read as ``arrival=``. The dataclasses validate themselves and
a bad value raises :class:`UsageError` naming the fix.
No I/O, no aiohttp here.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace

from gpulens.errors import UsageError

ARRIVALS = ("poisson", "constant")
CLIENTS = ("auto", "raw", "aiohttp")
SCENARIOS = ("single-stream", "server", "offline")
TENANT_FORMAT = "MODEL:rate=R[:slo_ms=S][:arrival=poisson|constant][:batch=B]"
TENANT_KEYS = ("rate", "slo_ms", "arrival", "batch")
KEY_ALIASES = {"arrivals": "arrival"}  # colocate's spelling
TENANT_EXAMPLE = "e.g. resnet50:rate=100:slo_ms=50 (or resnet50:rate=100,slo_ms=50)"
# Requests one run schedules up front (a few hundred bytes each while it runs): far beyond what
# one generator process sends (thousands per second), and rate=1e9 no longer exhausts memory
MAX_SCHEDULED_REQUESTS = 2_000_000


def _number(text: str, key: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(
            f"--tenant {spec!r}: {key}={text!r} is not a number; write {TENANT_FORMAT}"
        ) from None
    if not math.isfinite(value):
        raise UsageError(f"--tenant {spec!r}: {key} must be a finite number")
    return value


@dataclass(frozen=True)
class TenantSpec:
    """One tenant: a model on the server, its arrival rate (requests/s), its latency SLO."""

    model: str
    rate_rps: float | None  # None: a closed loop (--concurrency) sets the pace
    slo_ms: float | None = None
    arrival: str = "poisson"
    batch: int = 1
    openai: bool = False  # an OpenAI-compatible /v1/completions model instead of KServe v2

    def __post_init__(self) -> None:
        if not self.model or "/" in self.model or " " in self.model:
            raise UsageError(
                f"tenant model {self.model!r}: give a model name, e.g. {TENANT_FORMAT}"
            )
        if self.rate_rps is not None and not (self.rate_rps > 0 and math.isfinite(self.rate_rps)):
            raise UsageError(f"tenant {self.model}: rate must be > 0 requests/s, e.g. rate=50")
        if self.slo_ms is not None and not self.slo_ms > 0:
            raise UsageError(
                f"tenant {self.model}: slo_ms must be > 0 milliseconds, e.g. slo_ms=50"
            )
        if self.arrival not in ARRIVALS:
            raise UsageError(
                f"tenant {self.model}: arrival={self.arrival!r}; use one of {', '.join(ARRIVALS)}"
            )
        if self.batch < 1:
            raise UsageError(f"tenant {self.model}: batch must be 1 or more, e.g. batch=8")

    @classmethod
    def parse(cls, spec: str) -> TenantSpec:
        """``resnet50:rate=100:slo_ms=50`` or ``resnet50:rate=100,slo_ms=50`` -> TenantSpec.
        The model name ends at the first ':'; after it ':' and ',' both separate options (no
        option's value holds either)."""
        model, colon, rest = spec.partition(":")
        options = [p.strip() for p in re.split(r"[:,]", rest)] if colon else []
        values: dict[str, str] = {}
        for part in options:
            key, eq, value = part.partition("=")
            key = KEY_ALIASES.get(key.strip(), key.strip())
            if not eq or key not in TENANT_KEYS:
                raise UsageError(
                    f"--tenant {spec!r}: cannot read {part!r}; write {TENANT_FORMAT}, "
                    f"{TENANT_EXAMPLE}"
                )
            values[key] = value.strip()
        batch = _number(values.get("batch", "1"), "batch", spec)
        if batch != int(batch):
            raise UsageError(f"--tenant {spec!r}: batch must be a whole number")
        return cls(
            model=model.strip(),
            rate_rps=_number(values["rate"], "rate", spec) if "rate" in values else None,
            slo_ms=_number(values["slo_ms"], "slo_ms", spec) if "slo_ms" in values else None,
            arrival=values.get("arrival", "poisson"),
            batch=int(batch),
        )

    def with_rate(self, rate_rps: float) -> TenantSpec:
        return replace(self, rate_rps=rate_rps)


@dataclass(frozen=True)
class LoadConfig:
    """A whole load run. Times in seconds; ``binary_threshold_bytes``: inputs larger than this
    go as binary tensor data (KServe v2 extension), smaller ones as JSON."""

    url: str
    tenants: tuple[TenantSpec, ...]
    duration_s: float = 10.0
    warmup_s: float = 1.0
    seed: int = 0
    timeout_s: float = 10.0
    scenario: str | None = None
    price_per_hour_usd: float | None = None
    prompt_tokens: int = 128
    max_tokens: int = 64
    binary_threshold_bytes: int = 4096
    max_connections: int = 2048
    offline_requests: int | None = None
    # A closed loop instead of the open one: this many requests outstanding per tenant, each
    # sent when one returns (the tenants' rates are then not used); None: open loop.
    concurrency: int | None = None
    # (model, path): a tenant's request body from a file instead of from its metadata
    input_files: tuple[tuple[str, str], ...] = ()
    name: str | None = None
    client: str = (
        "auto"  # KServe requests: raw (fast, http:// only), aiohttp, or auto (raw on http)
    )

    def __post_init__(self) -> None:
        if not self.url or not self.url.startswith(("http://", "https://")):
            raise UsageError(
                f"--url {self.url!r}: give the server's base URL, e.g. --url http://127.0.0.1:8000"
            )
        object.__setattr__(self, "url", self.url.rstrip("/"))
        object.__setattr__(self, "tenants", tuple(self.tenants))
        if not self.tenants:
            raise UsageError(f"give at least one --tenant {TENANT_FORMAT}")
        names = [t.model for t in self.tenants]
        if len(set(names)) != len(names):
            raise UsageError("each --tenant model may appear once; merge the rates into one")
        # inf and nan are no lengths of time (nan passes every comparison's negation)
        if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise UsageError(f"--duration must be positive seconds, got {self.duration_s}")
        if not (self.warmup_s >= 0 and math.isfinite(self.warmup_s)):
            raise UsageError(f"--warmup must be 0 or more seconds, got {self.warmup_s}")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise UsageError(f"--timeout-s must be positive seconds, got {self.timeout_s}")
        if self.scenario is not None and self.scenario not in SCENARIOS:
            raise UsageError(f"--scenario {self.scenario!r}: use one of {', '.join(SCENARIOS)}")
        if self.scenario in ("single-stream", "offline") and len(self.tenants) != 1:
            raise UsageError(f"--scenario {self.scenario} takes exactly one --tenant")
        if self.scenario == "server" and any(t.slo_ms is None for t in self.tenants):
            raise UsageError(
                "--scenario server needs an SLO per tenant, e.g. MODEL:rate=50:slo_ms=50"
            )
        price = self.price_per_hour_usd
        if price is not None and not (price > 0 and math.isfinite(price)):
            raise UsageError("--price-per-hour must be a positive USD amount per hour")
        if self.prompt_tokens < 1 or self.max_tokens < 1:
            raise UsageError("--prompt-tokens and --max-tokens must be 1 or more")
        if self.client not in CLIENTS:
            raise UsageError(f"--client {self.client!r}: use one of {', '.join(CLIENTS)}")
        if self.client == "raw" and not self.url.startswith("http://"):
            raise UsageError("--client raw speaks plain http:// only: use --client aiohttp")
        if self.max_connections < 1:
            raise UsageError("--max-connections must be 1 or more")
        if self.offline_requests is not None and self.offline_requests < 1:
            raise UsageError(
                f"--offline-requests must be 1 or more, got {self.offline_requests} (leave it "
                "out for rate x duration)"
            )
        closed = self.concurrency is not None or self.scenario == "single-stream"
        offline_n = self.scenario == "offline" and self.offline_requests
        for t in self.tenants:
            if t.rate_rps is None and not (closed or offline_n):
                raise UsageError(
                    f"--tenant {t.model}: give a rate, e.g. {t.model}:rate=50 (or a closed "
                    "loop: --concurrency N)"
                )
        planned = self.scheduled_requests()
        if planned > MAX_SCHEDULED_REQUESTS:
            raise UsageError(
                f"the rates x (--warmup + --duration) schedule {planned:,.0f} requests, more "
                f"than the {MAX_SCHEDULED_REQUESTS:,} one run holds (one generator process "
                "sends a few thousand per second); lower the rate or --duration"
            )
        object.__setattr__(self, "input_files", tuple(tuple(f) for f in self.input_files))
        for model, _path in self.input_files:
            self.tenant(model)  # a usage error naming the tenants when it is none of them
        if self.concurrency is not None:
            if self.concurrency < 1:
                raise UsageError("--concurrency must be 1 or more requests outstanding")
            if self.scenario is not None:
                raise UsageError("--concurrency is a closed loop of its own: drop --scenario")

    def scheduled_requests(self) -> float:
        """How many requests the run schedules up front (0 for a closed loop, which sends
        each when one returns)."""
        if self.scenario == "offline":
            rate = self.tenants[0].rate_rps or 0.0
            return float(self.offline_requests or rate * self.duration_s)
        if self.concurrency is not None or self.scenario == "single-stream":
            return 0.0
        return sum((t.rate_rps or 0.0) * (self.warmup_s + self.duration_s) for t in self.tenants)

    def tenant(self, model: str) -> TenantSpec:
        for t in self.tenants:
            if t.model == model:
                return t
        raise UsageError(
            f"no --tenant for {model!r}: add --tenant {model}:rate=R (tenants: "
            f"{', '.join(t.model for t in self.tenants)})"
        )

    def with_tenant(self, spec: TenantSpec) -> LoadConfig:
        """The same run with one tenant replaced (same model name)."""
        return replace(
            self, tenants=tuple(spec if t.model == spec.model else t for t in self.tenants)
        )

    def as_dict(self) -> dict:
        """The requested configuration as stored in the run record."""
        return asdict(self)


SWEEP_FORMAT = "TENANT:rates=10,20,40 or TENANT:concurrency=1,2,4,8"


def parse_concurrency(values: str) -> tuple[int, ...]:
    """``1,2,4,8`` -> (1, 2, 4, 8): requests outstanding per trial."""
    try:
        levels = tuple(int(v) for v in values.split(",") if v.strip())
    except ValueError:
        raise UsageError(
            "--sweep: concurrency levels must be comma-separated integers, e.g. concurrency=1,2,4"
        ) from None
    if not levels or any(c < 1 for c in levels):
        raise UsageError("--sweep: give one or more concurrency levels >= 1, e.g. concurrency=1,4")
    return levels


def parse_rates(text: str) -> tuple[float, ...]:
    """``TENANT:rates=10,20,40`` (the ``--sweep`` value) without the tenant: ``rates=10,20,40``."""
    key, eq, values = text.partition("=")
    if key.strip() != "rates" or not eq:
        raise UsageError(f"--sweep: write {SWEEP_FORMAT} (got {text!r})")
    try:
        rates = tuple(float(v) for v in values.split(",") if v.strip())
    except ValueError:
        raise UsageError(
            "--sweep: rates must be comma-separated numbers, e.g. rates=10,20,40"
        ) from None
    if not rates or any(not r > 0 for r in rates):
        raise UsageError("--sweep: give one or more positive rates, e.g. rates=10,20,40")
    return rates


def parse_sweep(text: str) -> tuple[str, str, tuple[float, ...]]:
    """``resnet50:rates=10,20,40`` -> (``resnet50``, ``rates``, (10, 20, 40));
    ``resnet50:concurrency=1,4`` -> (``resnet50``, ``concurrency``, (1, 4))."""
    model, colon, rest = text.partition(":")
    if not colon or not model:
        raise UsageError(f"--sweep: write {SWEEP_FORMAT} (got {text!r})")
    key, eq, values = rest.partition("=")
    if key.strip() == "concurrency" and eq:
        return model, "concurrency", tuple(float(c) for c in parse_concurrency(values))
    return model, "rates", parse_rates(rest)
