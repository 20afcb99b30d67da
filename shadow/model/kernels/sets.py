"""The kernel sets: which kernels each set's forward runs, by name. Each set is its own
arithmetic (exact against itself, close to the others); `runtime` chooses one."""

from __future__ import annotations

import dataclasses

from shadow.model.kernels.attention import attention_batch_triton, attention_sdpa, attention_triton, warm_attention_triton
from shadow.model.kernels.fla import gated_rms_norm_fla, gdn_fla, gdn_fla_gated, gdn_fla_gated_batch
from shadow.model.kernels.reference import REFERENCE, Kernels
from shadow.model.kernels.torch_ops import causal_conv_rows, rms_norm_fused

# revision 1: fla's autotuning pinned (its configs, and with them the bits, may differ from a tuning)
FAST = Kernels(
    name="fla", gdn=gdn_fla, conv=causal_conv_rows, attention=attention_sdpa,
    norm=rms_norm_fused, gated_norm=gated_rms_norm_fla, gdn_gated=gdn_fla_gated, revision=1,
)
# `fused.FusedSteps` on these kernels; revision 2: also residual adds fused with the norms that read
# them, the attention gate in one kernel; a batched read's sessions in one GDN call a layer (the
# same bits as one call each)
FUSED = dataclasses.replace(FAST, name="fla-fused", fused=True, revision=2, gdn_gated_batch=gdn_fla_gated_batch)
# and Triton chunk attention; revision 3: GQA-packed, a batched read's sessions in one launch a layer, a
# row's slices merged one after another
TRITON = dataclasses.replace(FUSED, name="fla-triton", attention=attention_triton, attention_batch=attention_batch_triton,
                             warm_attention=warm_attention_triton, revision=3)
SETS = {"fast": TRITON, "fla-triton": TRITON, "fla-fused": FUSED, "fla": FAST}
BY_NAME = {"reference": REFERENCE, **SETS}
