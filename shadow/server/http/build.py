"""From settings to a running service: the shadow's model (at once in embedded mode, in the
background in proxy mode), its store, the embedded generator, the big model's template and
tokenizer, the standing question, the voice, the service and its HTTP app.

`build(settings)` is what `shadow serve` runs."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from fastapi import FastAPI

from shadow.core.reader import Reader, check_grid, open_reader
from shadow.core.residency import GIB, StateSize, embedded_cap_gib
from shadow.core.store import SessionStore
from shadow.engines.dialects import DIALECTS
from shadow.model.checkpoint import RANDOM_MARKER, read_config, resolve_checkpoint
from shadow.model.runtime import choose_kernels, load_model
from shadow.server import gcpauses
from shadow.server.generator import Generator
from shadow.server.host import Shadow
from shadow.server.http.app import ShadowApp
from shadow.server.service import ShadowService
from shadow.server.settings import ServeSettings, check
from shadow.server.standing import load_standing
from shadow.server.voicing import VoiceParts
from shadow.text.chat_template import renderer_for
from shadow.text.tokenizer import load_tokenizer

log = logging.getLogger("shadow.serve")


@dataclass
class Built:
    app: FastAPI
    service: ShadowService
    random: bool  # the shadow's weights are random: answers mean nothing, exactness and timing do


def dtype_of(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": None}[name]


def store_for(settings: ServeSettings, reader: Reader, weights_hash: str, cap_gib: float | None = None) -> SessionStore:
    """The shadow's store: its cap `cap_gib` (None: `StoreSettings.cap_for`), its disk folder (--disk,
    the default one, or none), its host tier."""
    s = settings.store
    device = reader.model.device.type
    cap = s.cap_for(device, settings.proxy) if cap_gib is None else cap_gib
    folder = s.folder
    log.info("the store: cap %.2f GiB%s, disk %s", cap, "" if s.cap_gib is not None else " (by default)",
             folder if folder is not None else "none (--no-disk: sessions past the caps are dropped)")
    return SessionStore(reader, weights_hash, cap_gib=cap, disk=folder, disk_cap_gib=s.disk_cap_gib,
                        model=settings.model.model, key=s.key, host_cap_gib=host_cap_gib(s.host_cap_gib, device),
                        pin_ahead_gib=s.pin_ahead_gib)


def embedded_cap(settings: ServeSettings, generator, free_bytes: int | None = None) -> float:
    """An embedded shadow's cap, GiB: --cap-gib, else (on a GPU) sized from the device memory free now
    that the generator is loaded (`residency.embedded_cap_gib`: less its requests' states at their
    longest and the prefix cache), logged with the figures it came from; off a GPU, `CAP_GIB`."""
    s, limits = settings.store, settings.limits
    device = generator.device
    if s.cap_gib is not None or device.type != "cuda":
        return s.cap_for(device.type, proxy=False)
    import torch

    if free_bytes is None:
        free_bytes, _ = torch.cuda.mem_get_info(device)
    size = StateSize.of(generator.config, torch.empty((), dtype=generator.dtype).element_size())
    requests = limits.max_generating * size.resident(size.capacity(limits.max_prompt_tokens + limits.max_tokens), 0)
    prefix = int(settings.prefix.gib * GIB) if settings.prefix.on else 0
    cap = embedded_cap_gib(free_bytes, requests, prefix)
    log.info("the resident cap: %.2f GiB, from %.2f GiB free once the generator loaded, less %.2f GiB for its "
             "requests at their longest and %.2f GiB of prefix cache", cap, free_bytes / GIB, requests / GIB, prefix / GIB)
    return cap


def host_cap_gib(asked: float, device: str, memory: int | None = None) -> float:
    """The host tier's bound for a shadow on `device`: none on the CPU (its sessions are in host
    memory already), else `asked`, at most half of the machine's `memory` (bytes; read from the
    system when not given), logged when cut."""
    if device != "cuda" or asked <= 0:
        return 0.0
    if memory is None:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    most = memory / 2**31
    if asked > most:
        log.warning("--host-cap-gib %g is more than half this machine's memory: the host tier takes %.1f GiB", asked, most)
        return most
    return asked


def build(settings: ServeSettings) -> Built:
    """The app for `settings` (checked first), and whether the shadow's weights are random."""
    check(settings)
    gcpauses.install()  # status shows the collector's pauses
    m = settings.model
    check_grid(m.grid)
    folder = resolve_checkpoint(m.model)
    config = read_config(folder)
    choose_kernels(m.kernels, m.device, config.linear_key_head_dim)  # a bad --kernels fails here, not in the background
    dtype = dtype_of(m.dtype)
    voice_reader = None
    if settings.voice.on and settings.voice.model:
        _, voice_reader = open_reader(settings.voice.model, grid=m.grid, device=m.device, dtype=dtype,
                                      kernels=m.kernels)
    engine = settings.engine
    if settings.proxy:  # requests pass through at once; the shadow loads in the background
        tokenizer = load_tokenizer(folder)
        renderer = renderer_for(engine.chat_template, engine.tokenizer, folder)
        dialect = None if engine.dialect == "auto" else DIALECTS[engine.dialect](
            renderer, template_kwargs=engine.template_kwargs, eos_id=config.eos_token_id)

        def load() -> Shadow:
            loaded, reader = open_reader(m.model, grid=m.grid, device=m.device, dtype=dtype, kernels=m.kernels)
            store = store_for(settings, reader, loaded.weights_hash)
            log.info("the shadow is ready: %s (%s), grid %d, %s", m.model, loaded.weights_label[:16], m.grid,
                     store.identity.arithmetic)
            return Shadow(reader, store, loaded.weights_label)

        service = ShadowService(settings, load, config, standing=_standing(settings, tokenizer),
                                voice=VoiceParts(tokenizer, voice_reader) if settings.voice.on else None)
        app = ShadowApp(settings, service, tokenizer, "upstream", renderer=renderer, dialect=dialect)
        return Built(app.app, service, (folder / RANDOM_MARKER).exists())
    # embedded: the generator needs its model before the first request (and the cap is sized after it loads)
    loaded, reader = open_reader(m.model, grid=m.grid, device=m.device, dtype=dtype, kernels=m.kernels)
    gen_model = loaded.model if m.generator in (None, m.model) else load_model(
        m.generator, dtype=dtype, device=m.device, kernels=loaded.model.kernels).model
    store = store_for(settings, reader, loaded.weights_hash, embedded_cap(settings, gen_model))
    tokenizer = load_tokenizer(loaded.path)
    service = ShadowService(settings, Shadow(reader, store, loaded.weights_label), config,
                            standing=_standing(settings, tokenizer),
                            voice=VoiceParts(tokenizer, voice_reader) if settings.voice.on else None)
    renderer = renderer_for(engine.chat_template, engine.tokenizer, None) if engine.chat_template else None
    app = ShadowApp(settings, service, tokenizer, m.generator or m.model, generator=Generator.on(gen_model),
                    renderer=renderer)
    log.info("the shadow is ready: %s (%s), grid %d, %s", m.model, loaded.weights_label[:16], m.grid,
             store.identity.arithmetic)
    return Built(app.app, service, loaded.random)


def _standing(settings: ServeSettings, tokenizer):
    return load_standing(settings.standing_question, tokenizer) if settings.standing_question else None
