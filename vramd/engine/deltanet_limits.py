"""The Gated DeltaNet kernels' size limits, apart from vramd/engine/deltanet.py (which imports the
GPU stack) so that the architecture registry checks a file against them before a device is opened."""

MAX_CONV = 8        # native/shaders/ssm_conv_silu.comp: MAXD
MAX_STATE = 128     # native/shaders/gated_delta.comp, gated_delta_chunked.comp: MAXS (their work group size)
