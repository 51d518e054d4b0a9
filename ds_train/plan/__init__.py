"""The arithmetic of a layout, pure and accelerator-free: the batch math (batch), the parallel
dimensions data x sequence x tensor (parallel), what a rank holds under each ZeRO stage (memory), and the
memory plan with its ranked fixes (planner).

It may import only the bottom: errors, config and dsconfig (a DeepSpeed template's ZeRO section).
"""
