"""Record the configs fla's autotuners choose on this GPU, for `shadow/model/autotune_pins.py`.

Runs the shapes the reader meets for each named preset (random weights, fast kernels; default
the 0.8B): grid chunks of 512, an ask over a pending tail, fork decode, and a prefill in
2,048-row chunks (verify-exact's other grid); then writes every autotuner's choices to
OUT/pins/<GPU>.json. Commit that file under shadow/model/kernels/pins/ to pin them. The pins already
committed for this GPU are applied first (the fast kernels apply them when picked), so a new
recording keeps their configs and adds the keys it meets: the bits of pinned shapes do not move.

    python3 experiments/pin_autotune.py OUT [PRESET ...]    # on the device, e.g. OUT qwen3.5-2b
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from shadow.offline.bench.readrate import ask_and_decode, random_ids
from shadow.core.reader import open_reader
from shadow.model import autotune_pins


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "out") / "pins"
    out.mkdir(parents=True, exist_ok=True)
    for preset in sys.argv[2:] or ["qwen3.5-0.8b"]:
        loaded, reader = open_reader(preset, device="cuda")
        ids = random_ids(4 * 2048, seed=5)
        reader.prefill(ids[:2048], chunk=2048)
        reader.prefill(ids, chunk=512)
        ask_and_decode(reader, 4 * 512 + 330, repeats=2, decode_tokens=4)
        torch.cuda.synchronize()
        del loaded, reader
        torch.cuda.empty_cache()
    path = out / autotune_pins.pins_path(torch.cuda.get_device_name()).name
    keys = autotune_pins.write(path)
    for name, entries in autotune_pins.record().items():
        print(f"{name}: {len(entries)} key(s)")
    print(f"{keys} keys written to {path}")


if __name__ == "__main__":
    main()
