"""Everything `shadow serve` is configured by, as one frozen tree (`ServeSettings`), with the checks
that need no file, model or network (`check`); `build.build` turns it into a running service; the
parts read the branch they need.

    ServeSettings
      model     ModelSettings     the shadow's checkpoint, the embedded generator's, grid, device
      store     StoreSettings     resident cap, host tier, restores ahead, disk, disk cap, unload slack, key
      prefix    PrefixCacheSettings the prefix cache: on or off, its bound
      schedule  BandwidthRule     idle window and in-turn share (`core.schedule`)
      read_costs KnownCosts       chunk and batch costs measured elsewhere, to start from (or None)
      engine    EngineSettings    proxy mode: the upstream, its dialect, the big model's template
      sessions  SessionSettings   which headers name a session, prefix matching, side branches
      status    StatusSettings    where status lines go, engine slots, line timing
      voice     VoiceSettings     the voice: on, its own model, its share
      limits    Limits            body, prompt, question and ask sizes, requests in flight
      access    Access            API and admin keys, probes without a key
      probes    ProbeSettings     liveness and readiness: how long they wait
      journal, standing_question, require_exact, shadow_on, log_format, log_level, shutdown_timeout_s, host, port

A field that is a command-line option carries its `Option` (help, flag, range, unit) in its
metadata (`setting`); `BandwidthRule`'s, whose module lies below this one, are `SCHEDULE`.
`options()` lists them all, each a `SettingOption` with its default in the option's unit, and
`settings_from` builds the tree from the options' values: the CLI generates `shadow serve`'s
options, and those `shadow replay-ledger` shares with it, from these alone.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, get_type_hints

from shadow.core.prefixcache import PREFIX_CACHE_GIB
from shadow.core.residency import (
    CAP_GIB, EMBEDDED_FLOOR_GIB, EMBEDDED_HEADROOM_GIB, EMBEDDED_SHARE, HOST_CAP_GIB, PIN_AHEAD_GIB,
)
from shadow.core.schedule import BandwidthRule, KnownCosts, Priorities
from shadow.errors import ShadowInputError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
SESSION_HEADERS = ("x-session-id", "x-openwebui-chat-id")
CHANNELS = ("auto", "reasoning", "content", "inline", "off")
ENGINES = ("vllm", "sglang", "llamacpp", "transformers", "openai")
SHADOW_PATHS = "/v1/shadow/"
METRICS_PATH = "/metrics"
PROBE_PATHS = ("/health", "/ready", "/health_generate")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
BATCHES = (1, 2, 4, 8)  # the batch sizes a reader has CUDA graphs for

# the panels of `shadow serve --help`
MODEL, STORE, READING, ENGINE, SESSIONS, LINES, VOICE, LIMITS, ACCESS, SERVICE, OPERATIONS = (
    "The shadow's model", "Memory and disk", "When the shadow reads", "Proxy mode: the engine", "Sessions",
    "Status lines", "The voice", "Limits", "Access", "Service", "Probes, metrics and logs")


@dataclass(frozen=True)
class Option:
    """How one settings field is given on the command line. `flag`: default `--name`, the name
    the field's (or `name`); `env`: the environment variable when it is not the command's rule
    (`SHADOW_SERVE_<FLAG>`); `check`: the kind of value the CLI checks it as while parsing (model,
    grid, device, dtype, kernels, file, path, tokenizer); `ge`/`gt`/`le`/`lt`/`allowed`: its range,
    in the option's unit, `says` the range in words for a refusal; `scale`: the option's unit per
    the field's (1000: a field in seconds given in ms); `text`: (field value to option text,
    option text to field value) for a field that is no plain value; `short`: a one-letter alias."""

    help: str
    panel: str
    flag: str | None = None
    name: str | None = None
    env: str | None = None
    check: str | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    allowed: tuple = ()
    says: str | None = None
    scale: float = 1.0
    text: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None
    short: str | None = None

    @property
    def ranged(self) -> bool:
        return any(b is not None for b in (self.ge, self.gt, self.le, self.lt)) or bool(self.allowed)


OPTION = "option"  # the metadata key of a field's `Option`
OPTIONS = "options"  # the metadata key of a branch's {field: Option}, for a branch defined below this module


def setting(default: Any = MISSING, *, factory: Callable[[], Any] | None = None, repr: bool = True, **option) -> Any:
    """A dataclass field whose value is an option (`Option(**option)` in its metadata)."""
    if factory is not None:
        return field(default_factory=factory, repr=repr, metadata={OPTION: Option(**option)})
    return field(default=default, repr=repr, metadata={OPTION: Option(**option)})


def _headers(text: str) -> tuple[str, ...]:
    return tuple(h.strip() for h in text.split(",") if h.strip())


def _priorities(text: str) -> Priorities:
    try:
        return Priorities.parse(text)
    except ValueError as e:
        raise ShadowInputError(f"--priorities: {e}") from None


def read_template_kwargs(text: str | None) -> dict:
    """--chat-template-kwargs as a JSON object ({} for none); ShadowInputError otherwise (not JSON,
    nested past Python's recursion limit, a number of thousands of digits)."""
    from shadow.engines.jsonlimits import collection_paused
    from shadow.text.chat_template import parse_template_kwargs

    try:
        with collection_paused():
            return parse_template_kwargs(text)
    except ShadowInputError:
        raise
    except (ValueError, RecursionError) as e:
        raise ShadowInputError(f"--chat-template-kwargs is not readable JSON ({type(e).__name__})") from None


def _kwargs_text(kwargs: dict) -> str | None:
    import json

    return json.dumps(kwargs) if kwargs else None


@dataclass(frozen=True)
class ModelSettings:
    """The shadow's model (a preset or a Qwen3.5 checkpoint folder) and how it runs; `generator`:
    the embedded generator's checkpoint (None: the shadow's own)."""

    model: str = setting("tiny", short="-m", check="model", panel=MODEL, help=(
        "The shadow: a preset (tiny, qwen3.5-0.8b, qwen3.5-2b, qwen3.5-4b: random weights) or a Qwen3.5 checkpoint "
        "folder."))
    generator: str | None = setting(None, name="generator_model", check="model", panel=MODEL, help=(
        "Embedded mode: the generator's checkpoint or preset (default: the shadow's own)."))
    grid: int = setting(512, check="grid", panel=MODEL, help="Grid G: rows per chunk (a positive multiple of 64).")
    device: str = setting("cpu", check="device", panel=MODEL, help=(
        "torch device: cpu, cuda, cuda:1 ... (checked before anything loads)."))
    dtype: str = setting("auto", check="dtype", panel=MODEL, help="Model dtype: auto, float32, bfloat16.")
    kernels: str = setting("auto", check="kernels", panel=MODEL, help=(
        "Kernels: auto, reference, fast (fla-triton), fla-fused, fla."))


@dataclass(frozen=True)
class StoreSettings:
    """Resident cap (GiB; None: by mode, `cap_for`), the host tier below it (GiB; 0: none), the
    folder sessions past both go to (None: `default_disk()`, unless `no_disk`), the bound on that
    folder, (proxy mode, with a disk) the free pool memory past which an idle shadow unloads, and
    the key of the session files' keyed digest (None: none)."""

    cap_gib: float | None = setting(None, gt=0, panel=STORE, help=(
        f"Resident cap for shadow sessions on the device, GiB. Default: in proxy mode and on the CPU {CAP_GIB:g} GiB "
        "(on the CPU there is no device memory to size it from); beside an engine on the same GPU, size it from what "
        "the engine leaves: the card's memory times 1 - vLLM's --gpu-memory-utilization, less the shadow's weights, "
        "--prefix-cache-gib and 1 GiB (docs/SERVE.md). In embedded mode on a GPU, sized once the generator is loaded: "
        f"{EMBEDDED_SHARE:g} of the free device memory less the generator's requests at their longest "
        "(--max-generating states of --max-prompt-tokens + --max-tokens) and the prefix cache, less "
        f"{EMBEDDED_HEADROOM_GIB:g} GiB, at least {EMBEDDED_FLOOR_GIB:g} GiB (logged at start)."))
    host_cap_gib: float = setting(HOST_CAP_GIB, ge=0, panel=STORE, help=(
        "Host-memory tier for sessions past --cap-gib, GiB: they move to host memory (pinned, bit for bit) and, past "
        "this, to --disk. 0: none. A shadow on the CPU has none (its sessions are in host memory already); at most "
        "half the machine's memory is taken."))
    pin_ahead_gib: float = setting(PIN_AHEAD_GIB, ge=0, panel=STORE, help=(
        "On a GPU, host memory the store keeps pinned and free ahead of the next moves to the host tier or disk, GiB, "
        "pinned on a thread of its own, never past --host-cap-gib plus the staging bound. At or past that bound, all "
        "of it is pinned when the service starts, so no move runs beside a pin (docs/STORE.md)."))
    restore_ahead: bool = setting(True, panel=STORE, help=(
        "A request that names its session starts bringing it back from the host tier or disk at once, on a thread "
        "(and a CUDA stream) of its own, beside the shadow's reads and the engine's prefill; --no-restore-ahead "
        "restores it when its prompt is fed, on the device between reads."))
    disk: Path | None = setting(None, panel=STORE, help=(
        "Folder where sessions past the caps (and all, at a planned stop) are written, and read back from at a "
        "restart. Default: 'sessions' in the cache folder ($SHADOW_CACHE, else ~/.cache/shadow); the store touches "
        "only its own files there."))
    no_disk: bool = setting(False, flag="--no-disk", panel=STORE, help=(
        "Run without a disk folder, whatever --disk says: sessions past the caps are dropped (read again from the "
        "start at their next turn) and a stop writes nothing."))
    disk_cap_gib: float = setting(64.0, gt=0, panel=STORE, help=(
        "Bound on the store's own files in --disk, GiB (oldest removed first)."))
    unload_slack_gib: float | None = setting(None, ge=0, panel=STORE, help=(
        "Proxy mode, with a disk folder (not --no-disk): after an idle burst that leaves more than this many GiB free "
        "in the shadow's CUDA memory pool, park every session on disk and unload the model. Default: never."))
    key: str | None = setting(None, repr=False, name="store_key", env="SHADOW_STORE_KEY", panel=STORE, help=(
        "A secret for the session files in --disk: each carries a keyed digest (HMAC-SHA256) made with it, and a "
        "file without that digest (planted by someone without the key) is refused."))

    @property
    def folder(self) -> Path | None:
        """The disk folder the store writes to: --disk, else the default one; None with --no-disk."""
        return None if self.no_disk else self.disk or default_disk()

    def cap_for(self, device: str, proxy: bool) -> float:
        """The resident cap, GiB, where it can be told before the model loads: --cap-gib, else
        `CAP_GIB` in proxy mode or off a GPU; embedded on a GPU it is sized after the generator
        loads (`residency.embedded_cap_gib`), so this raises there."""
        if self.cap_gib is not None:
            return self.cap_gib
        if proxy or device != "cuda":
            return CAP_GIB
        raise ValueError("an embedded shadow on a GPU sizes its cap once the generator is loaded")


def default_disk() -> Path:
    """The store's folder when --disk is not given: 'sessions' in the cache folder ($SHADOW_CACHE)."""
    from shadow.model.checkpoint import cache_dir

    return cache_dir() / "sessions"


@dataclass(frozen=True)
class PrefixCacheSettings:
    """The prefix cache (`core.prefixcache`): grid-line states shared by every session whose first
    ids are equal (a system prompt, tool definitions), on the shadow's device, bounded in GiB."""

    on: bool = setting(True, name="prefix_cache", panel=STORE, help=(
        "Keep the grid-line states of sessions' first prompts (KV rows and GDN state) in a bounded cache shared by "
        "every session: a session that reads from the start (a new one, a rollback to the start) starts at the "
        "deepest cached line its ids share, bit-equal to reading them; --no-prefix-cache reads every session from "
        "its start."))
    gib: float = setting(PREFIX_CACHE_GIB, name="prefix_cache_gib", gt=0, panel=STORE, help=(
        "The prefix cache's bound, GiB of the shadow's device memory (least recently used lines out first)."))


# `BandwidthRule`'s fields that are options (`core.schedule` lies below this module)
SCHEDULE = {
    "share": Option(gt=0, lt=1, says="must be between 0 and 1 (a fraction: 0.02 is 2 %)", panel=READING, help=(
        "In-turn share of the time since the first token the shadow may read (0.02 is 2 %).")),
    "slice_s": Option(flag="--slice-ms", name="slice_ms", scale=1000, gt=0, panel=READING, help=(
        "The longest a share slice may hold the device between two rounds, ms (whole chunks by their estimated "
        "cost).")),
    "batch": Option(allowed=BATCHES, says="is 1, 2, 4 or 8 (the batch sizes a reader has CUDA graphs for)",
                    panel=READING, help=(
        "Chunks one read may take together (2, 4 or 8: one forward, each session's state bit-equal to reading its "
        "chunks alone; 1: one chunk a read), in the idle window and in the share: taken in the order sessions are "
        "read, a session's next chunks first (read as one run), then the next session's.")),
    "batch_s": Option(flag="--batch-ms", name="batch_ms", scale=1000, gt=0, panel=READING, help=(
        "With --batch: the longest a batched read may hold the device at once, by estimate, ms: in the idle window "
        "(a request that comes waits for one read), and between two rounds in the share (the lower of this and "
        "--slice-ms).")),
    "batch_read_s": Option(flag="--batch-read-ms", name="batch_read_ms", scale=1000, gt=0, panel=READING, help=(
        "With --batch: the longest a batched read in the share may take in all, ms, read in pieces of at most "
        "--batch-ms between two rounds (the forward's pieces between its attention layers). Default: --batch-ms "
        "(one piece).")),
    "batch_wait_s": Option(flag="--batch-wait-ms", name="batch_wait_ms", scale=1000, ge=0, panel=READING, help=(
        "With --batch: while the share is busy (--batch-busy), a batch that could take more chunks than are ready "
        "waits up to this long for them, ms (0: never wait).")),
    "charge": Option(flag="--share-charge", name="share_charge", allowed=("wall", "alone"), says="is wall or alone",
                     panel=READING, help=(
        "What a read in the share charges the decode stretch: alone (default), the lesser of its own "
        "device-synchronised seconds and its cost as measured at load (beside an engine in another process on the "
        "same GPU, a read's seconds hold the engine's own work too); wall, those seconds.")),
    "batch_busy": Option(gt=0, le=1, panel=READING, help=(
        f"With --batch-wait-ms: the share is busy when its reads of the last {BandwidthRule.busy_window_s:g} s used at "
        f"least this part of the share of those seconds and less than {BandwidthRule.batch_bank_s:g} s of its budget "
        "is left.")),
}


@dataclass(frozen=True)
class EngineSettings:
    """Proxy mode: the engine's OpenAI-compatible base URL (None: embedded mode), its dialect
    ('auto' probes it), the big model's chat template and tokenizer, the template kwargs the
    engine applies by default, the engine's own key, and whether a turn without a label header
    asks the engine the standing question for one; the timeouts of every call to the engine
    (connect, first byte of the body, silence between two pieces, the dialect probe) and the
    watchdog's `timeout_s`."""

    upstream: str | None = setting(None, panel=ENGINE, help=(
        "Proxy mode: the engine's OpenAI-compatible base URL (e.g. http://127.0.0.1:8001/v1). Without it: embedded "
        "mode."))
    dialect: str = setting("auto", name="engine", panel=ENGINE, help=(
        "The engine's dialect (where the ids it read and wrote come from): vllm, sglang, llamacpp, transformers, "
        "openai; auto probes the engine."))
    chat_template: Path | None = setting(None, check="path", panel=ENGINE, help=(
        "The big model's chat template: a .jinja file, a tokenizer_config.json, or its checkpoint folder (default: "
        "the --tokenizer folder's, else the shadow checkpoint's)."))
    tokenizer: Path | None = setting(None, name="tokenizer_path", flag="--tokenizer", check="tokenizer", panel=ENGINE,
                                     help=(
        "The big model's tokenizer: a folder with tokenizer.json, or the file (default: the template's folder, else "
        "the real Qwen3.5 vocabulary). Embedded mode: with --chat-template only."))
    template_kwargs: dict = setting(factory=dict, name="chat_template_kwargs", text=(_kwargs_text, read_template_kwargs),
                                    panel=ENGINE, help=(
        "JSON object of template kwargs the engine applies by default (e.g. '{\"enable_thinking\": false}'); a "
        "request's own win."))
    upstream_key: str | None = setting(None, name="upstream_api_key", env="SHADOW_UPSTREAM_API_KEY", panel=ACCESS,
                                       help="Proxy mode: the engine's key, sent in place of the client's Authorization.")
    label_from_upstream: bool = setting(False, panel=ENGINE, help=(
        "With --standing-question: after a turn with no label header, ask the engine the standing question (one "
        "greedy token) and journal its answer as the reference label."))
    predict: bool = setting(True, panel=ENGINE, help=(
        "Proxy mode, chat requests with a chat template: hold each turn's output out of reading and, when the turn "
        "ends, predict with the template how much of it the next prompt keeps (a reply re-rendered, e.g. its "
        "reasoning dropped before a new user message, is not kept): that part is read, the rest stays held, "
        "unread, until the next prompt comes; confirmed or missed, counted in status. Off: the output is read as "
        "it streams, and the next prompt sends back what it changed."))
    read_ahead: bool = setting(False, panel=ENGINE, help=(
        "With --predict: at a turn's end the session takes the next prompt's start as the template will render it "
        "and reads it before that prompt comes. Until it comes those ids are unverified: asks answer exact: false "
        "(--require-exact refuses them)."))
    timeout_s: float = 600.0  # the watchdog: a turn in flight longer is listed as overdue
    connect_timeout_s: float = setting(10.0, name="engine_connect_timeout_s", gt=0, panel=ENGINE, help=(
        "Proxy mode: the longest a connection to the engine may take to open, s (504 beyond)."))
    first_byte_timeout_s: float = setting(300.0, name="engine_first_byte_timeout_s", gt=0, panel=ENGINE, help=(
        "Proxy mode: the longest the engine may take from the request to the first byte of its response's body, s "
        "(a stream's first event; a whole response's body, so all of a non-streamed generation): 504 beyond, and "
        "the turn ends."))
    idle_timeout_s: float = setting(60.0, name="engine_idle_timeout_s", gt=0, panel=ENGINE, help=(
        "Proxy mode: the longest the engine may send nothing between two pieces of a response's body, s (a stream "
        "then ends with an upstream_timeout error event, and the turn ends)."))
    probe_timeout_s: float = setting(5.0, name="engine_probe_timeout_s", gt=0, panel=ENGINE, help=(
        "Proxy mode, --engine auto: the longest the dialect probe waits for the engine's endpoints, s (asked all "
        "at once)."))


@dataclass(frozen=True)
class SessionSettings:
    """Request headers that name a session (first match wins), whether a request without one
    continues the resident session sharing its longest prefix, side branches kept a session."""

    headers: tuple[str, ...] = setting(SESSION_HEADERS, name="session_headers", text=(",".join, _headers),
                                       panel=SESSIONS, help=(
        "Request headers that name a session, first match wins (comma-separated)."))
    prefix_match: bool = setting(False, panel=SESSIONS, help=(
        "Without a session header, continue the resident session sharing the longest prefix with the prompt (off: "
        "two header-less users sharing a system prompt would land in one session)."))
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

    channel: str = setting("auto", name="status_channel", panel=LINES, help=(
        "Where status lines (waiting, reading N tokens, thinking, writing a file) go in streamed chat: auto (Open "
        "WebUI: status events, then reasoning; opencode: inline; other clients: none), reasoning, content, inline, "
        "off."))
    engine_slots: int = setting(1, ge=1, panel=LINES, help=(
        "Requests the engine prefills at once (llama.cpp's -np; high for vLLM and SGLang): a request waits behind "
        "that many."))
    timing: LineTiming = LineTiming()


@dataclass(frozen=True)
class VoiceSettings:
    """The voice: on or off, a checkpoint of its own (None: it forks the shadow's state), its share
    of the time since a turn's first token."""

    on: bool = setting(True, name="voice", panel=VOICE, help=(
        "The voice: a short phrase from the shadow's state after a thinking, decided or writing line, said only if "
        "it passes its checks (with random weights none does)."))
    model: str | None = setting(None, name="voice_model", check="model", panel=VOICE, help=(
        "A checkpoint (or preset) of its own for the voice, e.g. a real Qwen3.5-2B folder: it reads each session's "
        "newest 2,048 ids afresh (default: the voice forks the shadow's own state)."))
    share: float = setting(0.03, name="voice_share", ge=0, le=0.5, panel=VOICE, help=(
        "The voice's share of the time since a turn's first token (a phrase at a time; in embedded mode written a "
        "forward between each two rounds)."))


@dataclass(frozen=True)
class Limits:
    """How much one request may ask: body bytes, prompt tokens (embedded: refused beyond; proxy:
    passed on, not read), question and instruction tokens, tokens to generate and to summarise,
    the unread tail an ask may prefill in one fork, requests in flight, JSON nesting; in embedded
    mode, the requests generating or waiting to (429 beyond) and the generations that hold their
    state at once (taking turns on the device, a slice each); how long a body may take to arrive,
    how many bodies are read at once, and how long a write may wait for its client to read."""

    max_body_bytes: int = setting(32 * 2**20, name="max_body_mb", scale=2**-20, gt=0, panel=LIMITS,
                                  help="Largest request body, MiB (413 beyond).")
    max_prompt_tokens: int = setting(262_144, ge=1, panel=LIMITS, help=(
        "Longest prompt the embedded generator takes (400 beyond) or the shadow reads (proxy: longer prompts pass, "
        "unread)."))
    max_question_tokens: int = setting(8192, ge=1, panel=LIMITS, help="Longest ask question, tokens.")
    max_instruction_tokens: int = 4096
    max_tokens: int = setting(4096, ge=1, panel=LIMITS, help="Most tokens the embedded generator writes for one request.")
    max_summary_tokens: int = 512
    max_ask_tail: int = setting(16_384, ge=1, panel=LIMITS, help=(
        "Most unread ids an ask or summary may prefill in one fork; a session further behind answers 503 (ask "
        "again with a longer timeout_s)."))
    max_concurrent: int = setting(64, ge=1, panel=LIMITS, help=(
        "Completion, ask and summary requests in flight (429 beyond)."))
    max_json_depth: int = 64
    max_queued: int = setting(16, ge=1, panel=LIMITS, help=(
        "Embedded mode: requests generating or waiting for the generator (429 beyond)."))
    max_generating: int = setting(2, ge=1, panel=LIMITS, help=(
        "Embedded mode: generations that hold their state at once, taking turns on the device (a short request is "
        "served between a long prefill's chunks); the others wait in arrival order."))
    body_timeout_s: float = setting(30.0, gt=0, panel=LIMITS, help=(
        "The longest a request's body may take to arrive, from the request's start, s (408 beyond); a body still "
        "arriving holds no request slot."))
    max_sending: int = setting(16, ge=1, panel=LIMITS, help=(
        "Requests whose body is still arriving, read at once; more wait their turn (within --body-timeout-s)."))
    write_timeout_s: float = setting(30.0, gt=0, panel=LIMITS, help=(
        "The longest one write to a client may wait for it to read, s: beyond, the connection is closed and its "
        "turn ends (an embedded generation stops and frees its slot; a proxied one closes its engine request)."))


@dataclass(frozen=True)
class Access:
    """With an API key, every endpoint wants `Authorization: Bearer KEY`; the shadow's own
    endpoints (`/v1/shadow/*`) and `/metrics` want the admin key instead when one is set, and the
    admin key opens every endpoint (one key runs both arms of `shadow ab`). The probes (`/health`,
    `/ready`, `/health_generate`) want a key like every endpoint, unless `probes_without_key`."""

    api_key: str | None = setting(None, env="SHADOW_API_KEY", panel=ACCESS, help=(
        "Require 'Authorization: Bearer KEY' on every endpoint (required to listen beyond loopback)."))
    admin_key: str | None = setting(None, env="SHADOW_ADMIN_KEY", panel=ACCESS, help=(
        "A separate key for the shadow's own endpoints (ask, summarize, status, switch) and /metrics; it opens the "
        "others too."))
    probes_without_key: bool = setting(False, name="health_without_key", panel=ACCESS, help=(
        "GET /health, /ready and /health_generate answer without a key (default: with an --api-key set they want it "
        "too). /metrics always wants the admin key, else the API key."))

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
    must answer `GET {upstream}/models` within `engine_timeout_s`, with a status below 500.
    `/health_generate`: one token generated within `generate_timeout_s`, the answer kept
    `generate_cache_s`."""

    wait_s: float = 1.0
    stuck_s: float = setting(300.0, name="health_stuck_s", ge=0, panel=OPERATIONS, help=(
        "GET /health answers 503 once a no-op job has waited this long for the device thread (a model load or a "
        "long generation holds it meanwhile)."))
    engine_timeout_s: float = setting(2.0, name="ready_engine_timeout_s", ge=0, panel=OPERATIONS, help=(
        "Proxy mode: GET /ready answers 503 when the engine's /models does not answer below 500 within this many "
        "seconds."))
    generate_timeout_s: float = setting(30.0, name="health_generate_timeout_s", gt=0, panel=OPERATIONS, help=(
        "GET /health_generate answers 503 when one generated token (through the engine, or the embedded generator) "
        "takes longer than this, s."))
    generate_cache_s: float = 5.0  # a /health_generate answer serves the probes of the next seconds


@dataclass(frozen=True)
class ServeSettings:
    model: ModelSettings = ModelSettings()
    store: StoreSettings = StoreSettings()
    prefix: PrefixCacheSettings = PrefixCacheSettings()
    schedule: BandwidthRule = field(default=BandwidthRule(), metadata={OPTIONS: SCHEDULE})
    priorities: Priorities = setting(Priorities(), text=(lambda p: p.label, _priorities), panel=READING, help=(
        "The order sessions are read in: all (a question first, then turns in flight, the most recent turn, the "
        "oldest backlog), none, or steps among question,running,fewest,recent,oldest joined by commas. Adding "
        "fewest (the session nearest to fresh first) makes more turn starts fresh when the share cannot keep up, at "
        "the cost of the sessions furthest behind (`shadow replay-ledger --priorities` replays both)."))
    read_costs: KnownCosts | None = None  # costs measured elsewhere the scheduler starts from (`--read-rate-json`)
    engine: EngineSettings = EngineSettings()
    sessions: SessionSettings = SessionSettings()
    status: StatusSettings = StatusSettings()
    voice: VoiceSettings = VoiceSettings()
    limits: Limits = Limits()
    access: Access = Access()
    probes: ProbeSettings = ProbeSettings()
    journal: Path | None = setting(None, panel=SERVICE, help=(
        "JSONL journal (mode 0600) of every turn's check against the engine and every question asked, with its "
        "answer, lag and backlog."))
    standing_question: Path | None = setting(None, check="file", panel=SERVICE, help=(
        "A JSON file {name, text, choices, min_prompt_tokens (8192), label_header (x-shadow-label)}: asked of the "
        "shadow at every turn with at least that many prompt tokens, at the prompt's last <|im_end|>, journaled "
        "beside the turn's label header."))
    require_exact: bool = setting(False, panel=SERVICE, help=(
        "Asks and summaries about a session whose ids are not all verified against the engine answer 409 with the "
        "reason."))
    # off: the shadow feeds and reads nothing until switched on (`/v1/shadow/switch`)
    shadow_on: bool = setting(True, name="shadow", panel=SERVICE, help=(
        "Start with the shadow on; --no-shadow serves completions alone (e.g. an embedded engine for another "
        "serve's proxy to read), until POST /v1/shadow/switch turns it on."))
    log_format: str = setting("text", panel=OPERATIONS, help=(  # one of LOG_FORMATS: json is one object a line
        "Log lines on stderr: text, or json (one object a line, with the session and turn where the line has them; "
        "uvicorn's lines too)."))
    log_level: str = setting("info", panel=OPERATIONS, help=(  # one of LOG_LEVELS
        "The least level of the service's log lines: debug, info (each request's access line, what the service "
        "did), warning or error; other libraries' lines from warning (or this level, if higher)."))
    shutdown_timeout_s: float = setting(20.0, ge=0, panel=OPERATIONS, help=(
        "On SIGTERM or SIGINT: the idle sessions are written first, then turns in flight get this long to end "
        "(then they are cut), then every session is written and the process exits 0 (1 when a session could not "
        "be written); a second signal exits at once. Under an orchestrator's grace period (Kubernetes: 30 s)."))
    host: str = setting("127.0.0.1", panel=SERVICE, help=(
        "Address to listen on. Beyond loopback, an --api-key is required."))
    port: int = setting(8000, ge=1, le=65535, panel=SERVICE, help="Port to listen on.")

    @property
    def proxy(self) -> bool:
        return self.engine.upstream is not None


@dataclass(frozen=True)
class SettingOption:
    """One option of the settings tree: `path` to its field from `ServeSettings` (("store",
    "cap_gib")), its `Option`, and the field's default and type."""

    path: tuple[str, ...]
    option: Option
    field_default: Any
    field_type: Any

    @property
    def name(self) -> str:
        """The option's parameter name (and --config key)."""
        return self.option.name or self.path[-1]

    @property
    def flag(self) -> str:
        return self.option.flag or "--" + self.name.replace("_", "-")

    @property
    def type(self) -> Any:
        """The option's value type: text for a field read from text, a number in the option's unit."""
        if self.option.text is not None:
            return str if self.default is not None else str | None
        if self.option.scale != 1:
            return float if self.field_default is not None else float | None
        return self.field_type

    @property
    def default(self) -> Any:
        """The field's default in the option's unit."""
        return self.shown(self.field_default)

    def shown(self, value: Any) -> Any:
        """A field value as the option's value."""
        if self.option.text is not None:
            return self.option.text[0](value)
        if value is None or self.option.scale == 1:
            return value
        return value * self.option.scale

    def field_value(self, value: Any) -> Any:
        """An option's value as the field's (ShadowInputError where its text cannot be read)."""
        if self.option.text is not None:
            return self.option.text[1](value)
        if value is None or self.option.scale == 1:
            return value
        read = value / self.option.scale
        return int(read) if self.field_type is int else read


def options(tree: type = ServeSettings, under: tuple[str, ...] = ()) -> list[SettingOption]:
    """Every option of the settings tree, in the order of its fields."""
    out = []
    hints = get_type_hints(tree)
    for f in fields(tree):
        default = f.default_factory() if f.default is MISSING else f.default
        if OPTION in f.metadata:
            out.append(SettingOption((*under, f.name), f.metadata[OPTION], default, hints[f.name]))
        elif OPTIONS in f.metadata:
            branch = get_type_hints(type(default))
            out += [SettingOption((*under, f.name, name), option, getattr(default, name), branch[name])
                    for name, option in f.metadata[OPTIONS].items()]
        elif is_dataclass(default):
            out += options(type(default), (*under, f.name))
    return out


def settings_from(values: Mapping[str, Any], base: ServeSettings = ServeSettings()) -> ServeSettings:
    """`base` with each option named in `values` (by its parameter name) set to its value there;
    ShadowInputError for a value whose text cannot be read (--priorities, --chat-template-kwargs)."""
    changes: dict[tuple[str, ...], Any] = {}
    for s in options(type(base)):
        if s.name in values:
            changes[s.path] = s.field_value(values[s.name])
    return _replaced(base, changes)


def _replaced(node: Any, changes: dict[tuple[str, ...], Any]) -> Any:
    """`node` with each (relative path, value) of `changes` set, branch by branch."""
    own = {path[0]: value for path, value in changes.items() if len(path) == 1}
    deeper: dict[str, dict] = {}
    for path, value in changes.items():
        if len(path) > 1:
            deeper.setdefault(path[0], {})[path[1:]] = value
    own |= {name: _replaced(getattr(node, name), sub) for name, sub in deeper.items()}
    return replace(node, **own) if own else node


def check(s: ServeSettings) -> None:
    """ShadowInputError for settings that cannot work together or are out of range; checks no file
    but those whose kind is wrong (a --disk that is a file, a --journal in no folder)."""
    if s.store.key is not None and not s.store.key:
        raise ShadowInputError("--store-key is empty (give a key, or leave it out for no keyed digest)")
    for flag, key in (("--api-key", s.access.api_key), ("--admin-key", s.access.admin_key),
                      ("--upstream-api-key", s.engine.upstream_key)):
        if key is not None and not key.strip():  # an empty bearer token would open the API to anyone
            raise ShadowInputError(f"{flag} is empty (give a key, or leave it out)")
    if not 0 < s.schedule.share < 1:
        raise ShadowInputError("--share must be between 0 and 1 (a fraction: 0.02 is 2 %)")
    if not (math.isfinite(s.schedule.slice_s) and s.schedule.slice_s > 0):
        raise ShadowInputError("--slice-ms must be a positive number")
    if s.schedule.batch not in (1, 2, 4, 8):
        raise ShadowInputError(f"--batch is 1, 2, 4 or 8 (the batch sizes a reader has CUDA graphs for; got {s.schedule.batch})")
    if s.engine.label_from_upstream and (not s.proxy or s.standing_question is None):
        raise ShadowInputError("--label-from-upstream needs proxy mode (--upstream) and a --standing-question")
    if s.store.unload_slack_gib is not None and (not s.proxy or s.store.folder is None):
        raise ShadowInputError("--unload-slack-gib needs proxy mode (--upstream) and a disk to park sessions on "
                               "(a --disk, not --no-disk)")
    if s.engine.dialect != "auto" and s.engine.dialect not in ENGINES:
        raise ShadowInputError(f"--engine must be auto or one of {', '.join(ENGINES)}")
    if s.log_format not in LOG_FORMATS:
        raise ShadowInputError(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
    if s.log_level not in LOG_LEVELS:
        raise ShadowInputError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
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
    folder = s.store.folder
    if folder is not None and folder.exists() and not folder.is_dir():
        raise ShadowInputError(f"--disk {folder} is a file, not a folder")
    if s.journal is not None and (s.journal.is_dir() or not s.journal.parent.is_dir()):
        raise ShadowInputError(f"--journal {s.journal} must be a file in an existing folder")
    if not 1 <= s.limits.max_generating <= s.limits.max_queued:
        raise ShadowInputError("--max-generating must be at least 1 and at most --max-queued")
    if s.engine.tokenizer is not None and not s.proxy and s.engine.chat_template is None:
        raise ShadowInputError("--tokenizer in embedded mode needs --chat-template (the generator renders with "
                               "the in-code template otherwise, and reads no tokenizer)")
    if not (math.isfinite(s.engine.timeout_s) and s.engine.timeout_s > 0):
        raise ShadowInputError("the engine's timeout must be a positive number of seconds")
    for name, value in (("--engine-connect-timeout-s", s.engine.connect_timeout_s),
                        ("--engine-first-byte-timeout-s", s.engine.first_byte_timeout_s),
                        ("--engine-idle-timeout-s", s.engine.idle_timeout_s),
                        ("--engine-probe-timeout-s", s.engine.probe_timeout_s),
                        ("--body-timeout-s", s.limits.body_timeout_s), ("--write-timeout-s", s.limits.write_timeout_s),
                        ("--health-generate-timeout-s", s.probes.generate_timeout_s)):
        if not (math.isfinite(value) and value > 0):
            raise ShadowInputError(f"{name} must be a positive number of seconds")
    if not (math.isfinite(s.prefix.gib) and s.prefix.gib > 0):
        raise ShadowInputError("--prefix-cache-gib must be a positive number of GiB (--no-prefix-cache: none)")
    for name, value in (("--max-body-mb", s.limits.max_body_bytes), ("--cap-gib", s.store.cap_gib),
                        ("--disk-cap-gib", s.store.disk_cap_gib), ("--voice-share", s.voice.share)):
        if value is not None and not math.isfinite(value):
            raise ShadowInputError(f"{name} must be a finite number")
