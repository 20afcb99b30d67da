"""Everything `shadow serve` is configured by, as one frozen tree (`ServeSettings`), with the checks
that need no file, model or network (`check`). The CLI maps its options onto it one for one;
`build.build` turns it into a running service; the parts read the branch they need.

    ServeSettings
      model     ModelSettings     the shadow's checkpoint, the embedded generator's, grid, device
      store     StoreSettings     resident cap, disk, disk cap, unload slack
      schedule  BandwidthRule     idle window and in-turn share (`core.schedule`)
      read_costs KnownCosts       chunk and batch costs measured elsewhere, to start from (or None)
      engine    EngineSettings    proxy mode: the upstream, its dialect, the big model's template
      sessions  SessionSettings   which headers name a session, prefix matching, side branches
      status    StatusSettings    where status lines go, engine slots, line timing
      voice     VoiceSettings     the voice: on, its own model, its share
      limits    Limits            body, prompt, question and ask sizes, requests in flight
      access    Access            API and admin keys, probes without a key
      probes    ProbeSettings     liveness and readiness: how long they wait
      journal, standing_question, require_exact, shadow_on, log_format, host, port
"""

from __future__ import annotations

import hmac
import math
from dataclasses import dataclass, field
from pathlib import Path

from shadow.core.schedule import BandwidthRule, KnownCosts, Priorities
from shadow.errors import ShadowInputError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
SESSION_HEADERS = ("x-session-id", "x-openwebui-chat-id")
CHANNELS = ("auto", "reasoning", "content", "inline", "off")
ENGINES = ("vllm", "sglang", "llamacpp", "transformers", "openai")
SHADOW_PATHS = "/v1/shadow/"
METRICS_PATH = "/metrics"
PROBE_PATHS = ("/health", "/ready")
LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class ModelSettings:
    """The shadow's model (a preset or a Qwen3.5 checkpoint folder) and how it runs; `generator`:
    the embedded generator's checkpoint (None: the shadow's own)."""

    model: str = "tiny"
    generator: str | None = None
    grid: int = 512
    device: str = "cpu"
    dtype: str = "auto"
    kernels: str = "auto"


@dataclass(frozen=True)
class StoreSettings:
    """Resident cap (GiB; None: no cap), the folder sessions past it go to, the bound on that
    folder, (proxy mode, with a disk) the free pool memory past which an idle shadow unloads, and
    the key of the session files' keyed digest (None: none)."""

    cap_gib: float | None = 4.0
    disk: Path | None = None
    disk_cap_gib: float = 64.0
    unload_slack_gib: float | None = None
    key: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class EngineSettings:
    """Proxy mode: the engine's OpenAI-compatible base URL (None: embedded mode), its dialect
    ('auto' probes it), the big model's chat template and tokenizer, the template kwargs the
    engine applies by default, the engine's own key, and whether a turn without a label header
    asks the engine the standing question for one."""

    upstream: str | None = None
    dialect: str = "auto"
    chat_template: Path | None = None
    tokenizer: Path | None = None
    template_kwargs: dict = field(default_factory=dict)
    upstream_key: str | None = None
    label_from_upstream: bool = False
    timeout_s: float = 600.0


@dataclass(frozen=True)
class SessionSettings:
    """Request headers that name a session (first match wins), whether a request without one
    continues the resident session sharing its longest prefix, side branches kept a session."""

    headers: tuple[str, ...] = SESSION_HEADERS
    prefix_match: bool = False
    max_branches: int = 8


@dataclass(frozen=True)
class LineTiming:
    """When status lines are due: nothing for the first `quiet_s`, progress every
    `progress_every_s`, thinking from `thinking_from_s` every `thinking_every_s`, a decision after a
    thought of `decided_after_s`."""

    quiet_s: float = 1.5
    progress_every_s: float = 10.0
    thinking_from_s: float = 15.0
    thinking_every_s: float = 25.0
    decided_after_s: float = 10.0


@dataclass(frozen=True)
class StatusSettings:
    """Where status lines go in streamed chat (`CHANNELS`), how many requests the engine prefills
    at once (llama.cpp's -np), and the lines' timing."""

    channel: str = "auto"
    engine_slots: int = 1
    timing: LineTiming = LineTiming()


@dataclass(frozen=True)
class VoiceSettings:
    """The voice: on or off, a checkpoint of its own (None: it forks the shadow's state), its share
    of the time since a turn's first token."""

    on: bool = True
    model: str | None = None
    share: float = 0.03


@dataclass(frozen=True)
class Limits:
    """How much one request may ask: body bytes, prompt tokens (embedded: refused beyond; proxy:
    passed on, not read), question and instruction tokens, tokens to generate and to summarise,
    the unread tail an ask may prefill in one fork, requests in flight, JSON nesting; in embedded
    mode, the requests generating or waiting to (429 beyond) and the generations that hold their
    state at once (taking turns on the device, a slice each)."""

    max_body_bytes: int = 32 * 2**20
    max_prompt_tokens: int = 262_144
    max_question_tokens: int = 8192
    max_instruction_tokens: int = 4096
    max_tokens: int = 4096
    max_summary_tokens: int = 512
    max_ask_tail: int = 16_384
    max_concurrent: int = 64
    max_json_depth: int = 64
    max_queued: int = 16
    max_generating: int = 2


@dataclass(frozen=True)
class Access:
    """With an API key, every endpoint wants `Authorization: Bearer KEY`; the shadow's own
    endpoints (`/v1/shadow/*`) and `/metrics` want the admin key instead when one is set, and the
    admin key opens every endpoint (one key runs both arms of `shadow ab`). The probes (`/health`,
    `/ready`) want a key like every endpoint, unless `probes_without_key`."""

    api_key: str | None = None
    admin_key: str | None = None
    probes_without_key: bool = False

    def allows(self, path: str, authorization: str | None) -> bool:
        """Whether `authorization` opens `path` (keys compared in constant time)."""
        if self.probes_without_key and path in PROBE_PATHS:
            return True
        admin = path.startswith(SHADOW_PATHS) or path == METRICS_PATH
        want = self.admin_key if (admin and self.admin_key) else self.api_key
        if want is None:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        token = token.strip().encode()
        opens = [want] if admin or not self.admin_key else [want, self.admin_key]
        return any([hmac.compare_digest(token, key.encode()) for key in opens])  # a list: both compared


@dataclass(frozen=True)
class ProbeSettings:
    """Liveness (`/health`): the device thread must run a no-op job within `stuck_s` of it being
    handed in (each probe waits at most `wait_s` for it; a job running longer, a model load or a
    long generation, is no failure until then). Readiness (`/ready`, proxy mode): the engine
    must answer `GET {upstream}/models` within `engine_timeout_s`, with a status below 500."""

    wait_s: float = 1.0
    stuck_s: float = 300.0
    engine_timeout_s: float = 2.0


@dataclass(frozen=True)
class ServeSettings:
    model: ModelSettings = ModelSettings()
    store: StoreSettings = StoreSettings()
    schedule: BandwidthRule = BandwidthRule()
    priorities: Priorities = Priorities()  # the order sessions are read in (`--priorities`)
    read_costs: KnownCosts | None = None  # costs measured elsewhere the scheduler starts from (`--read-rate-json`)
    engine: EngineSettings = EngineSettings()
    sessions: SessionSettings = SessionSettings()
    status: StatusSettings = StatusSettings()
    voice: VoiceSettings = VoiceSettings()
    limits: Limits = Limits()
    access: Access = Access()
    probes: ProbeSettings = ProbeSettings()
    journal: Path | None = None
    standing_question: Path | None = None
    require_exact: bool = False
    shadow_on: bool = True  # off: the shadow feeds and reads nothing until switched on (`/v1/shadow/switch`)
    log_format: str = "text"  # one of LOG_FORMATS: json is one object a line
    host: str = "127.0.0.1"
    port: int = 8000

    @property
    def proxy(self) -> bool:
        return self.engine.upstream is not None


def check(s: ServeSettings) -> None:
    """ShadowInputError for settings that cannot work together or are out of range; checks no file
    but those whose kind is wrong (a --disk that is a file, a --journal in no folder)."""
    if s.store.key is not None and not s.store.key:
        raise ShadowInputError("--store-key is empty (give a key, or leave it out for no keyed digest)")
    if not 0 < s.schedule.share < 1:
        raise ShadowInputError("--share must be between 0 and 1 (a fraction: 0.02 is 2 %)")
    if not (math.isfinite(s.schedule.slice_s) and s.schedule.slice_s > 0):
        raise ShadowInputError("--slice-ms must be a positive number")
    if s.schedule.batch not in (1, 2, 4, 8):
        raise ShadowInputError(f"--batch is 1, 2, 4 or 8 (the batch sizes a reader has CUDA graphs for; got {s.schedule.batch})")
    if s.engine.label_from_upstream and (not s.proxy or s.standing_question is None):
        raise ShadowInputError("--label-from-upstream needs proxy mode (--upstream) and a --standing-question")
    if s.store.unload_slack_gib is not None and (not s.proxy or s.store.disk is None):
        raise ShadowInputError("--unload-slack-gib needs proxy mode (--upstream) and a --disk to park sessions on")
    if s.engine.dialect != "auto" and s.engine.dialect not in ENGINES:
        raise ShadowInputError(f"--engine must be auto or one of {', '.join(ENGINES)}")
    if s.log_format not in LOG_FORMATS:
        raise ShadowInputError(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
    p = s.probes
    if not all(math.isfinite(v) and v >= 0 for v in (p.wait_s, p.stuck_s, p.engine_timeout_s)):
        raise ShadowInputError("--health-stuck-s and --ready-engine-timeout-s must be finite numbers, 0 or more")
    if s.status.channel not in CHANNELS:
        raise ShadowInputError(f"--status-channel must be one of {', '.join(CHANNELS)}")
    if s.proxy and not s.engine.upstream.startswith(("http://", "https://")):
        raise ShadowInputError(f"--upstream {s.engine.upstream!r} is not an http(s) URL")
    if s.host not in LOOPBACK and not s.access.api_key:
        raise ShadowInputError(f"listening on {s.host} (beyond loopback) needs an --api-key (or SHADOW_API_KEY)")
    if not s.sessions.headers:
        raise ShadowInputError("--session-headers names no header")
    if s.store.disk is not None and s.store.disk.exists() and not s.store.disk.is_dir():
        raise ShadowInputError(f"--disk {s.store.disk} is a file, not a folder")
    if s.journal is not None and (s.journal.is_dir() or not s.journal.parent.is_dir()):
        raise ShadowInputError(f"--journal {s.journal} must be a file in an existing folder")
    if not 1 <= s.limits.max_generating <= s.limits.max_queued:
        raise ShadowInputError("--max-generating must be at least 1 and at most --max-queued")
    if s.engine.tokenizer is not None and not s.proxy and s.engine.chat_template is None:
        raise ShadowInputError("--tokenizer in embedded mode needs --chat-template (the generator renders with "
                               "the in-code template otherwise, and reads no tokenizer)")
    if not (math.isfinite(s.engine.timeout_s) and s.engine.timeout_s > 0):
        raise ShadowInputError("the engine's timeout must be a positive number of seconds")
    for name, value in (("--max-body-mb", s.limits.max_body_bytes), ("--cap-gib", s.store.cap_gib),
                        ("--disk-cap-gib", s.store.disk_cap_gib), ("--voice-share", s.voice.share)):
        if value is not None and not math.isfinite(value):
            raise ShadowInputError(f"{name} must be a finite number")
