"""Building block-diagonal matrices from blocks, and recovering the blocks."""

import torch

import blockdiag

from .common import asv_sampling, grid, parse_block

BUILDERS = {
    "dense": blockdiag.block_diag_dense,
    "csr": blockdiag.block_diag_csr,
    "bsr": blockdiag.block_diag_bsr,
    "coo": blockdiag.block_diag_coo,
}


@asv_sampling
class Build:
    """``block_diag_<layout>(blocks)`` for blocks ``[groups, out, in]``."""

    params = (list(BUILDERS), grid([16, 256], [4]), grid(["10x10", "64x64"], ["8x8"]))
    param_names = ["layout", "groups", "block"]

    def setup(self, layout, groups, block):
        i, o = parse_block(block)
        if layout == "dense" and groups * groups * i * o > 1 << 26:
            raise NotImplementedError("dense matrix over 64M entries: not a realistic use")
        self.blocks = torch.randn(groups, o, i)
        self.build = BUILDERS[layout]
        self.build(self.blocks)  # warm the cached index tensors, as a model's second step would

    def time_build(self, layout, groups, block):
        self.build(self.blocks)


@asv_sampling
class ToBlocks:
    """``to_blocks(matrix, groups)`` from each layout back to ``[groups, out, in]``."""

    params = Build.params
    param_names = Build.param_names

    def setup(self, layout, groups, block):
        Build.setup(self, layout, groups, block)
        self.matrix = self.build(self.blocks)
        self.groups = groups
        blockdiag.to_blocks(self.matrix, groups)

    def time_to_blocks(self, layout, groups, block):
        blockdiag.to_blocks(self.matrix, self.groups)
