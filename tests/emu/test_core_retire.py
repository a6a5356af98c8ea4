"""A finished core's context and the tiles it holds are freed by reference counting as soon as the core ends, with
no garbage-collection pass: a collection after a run walked every tile of every core (0.2 s of a 1.5 s mla_prolog
call, 30k objects)."""
from __future__ import annotations

import gc
import weakref

from ascend_emu import Pod, cloudmatrix384, kernel


def test_a_finished_cores_context_and_tiles_are_freed_without_a_collection():
    refs = []

    @kernel(cores="aiv")
    def keeps_a_tile_on_its_context(ctx):
        ctx.kept = ctx.ub.alloc((64,), "fp32", name="kept")       # as a kernel's phase region (mla's ctx.carve)
        yield ctx.vec.duplicate(ctx.kept, 1.0)
        refs.append(weakref.ref(ctx.kept))

    pod = Pod(cloudmatrix384(dies=1), trace=False)
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        pod.launch(keeps_a_tile_on_its_context, die=0, aiv=2)
        assert len(refs) == 2
        assert [r() for r in refs] == [None, None]
    finally:
        if was:
            gc.enable()
