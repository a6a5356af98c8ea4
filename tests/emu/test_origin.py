"""Trace origins (ascend_emu.origin): one shared args dict per issuing site, right however code objects come and go."""
import gc

from ascend_emu import Pod, cloudmatrix384, kernel
from ascend_emu.origin import origin_of


def _generator(name: str, pad_lines: int):
    """A fresh generator function ``name`` whose yield sits ``pad_lines`` lines down (its own code object)."""
    src = f"def {name}():\n" + "    pass\n" * pad_lines + "    yield 0\n    yield 1\n"
    scope = {}
    exec(compile(src, f"<{name}>", "exec"), scope)
    return scope[name]


def test_a_site_gives_one_shared_dict_and_two_yields_of_one_line_two_sites():
    sites = {}
    g = _generator("k", 2)()
    next(g)
    first = origin_of(sites, g, "launch")
    assert origin_of(sites, g, "launch") is first
    assert first == {"kernel": "launch", "function": "k", "source": "<k>:4"}
    next(g)                                   # the second yield: another bytecode offset, the next line
    second = origin_of(sites, g, "launch")
    assert second is not first and second["source"] == "<k>:5"
    assert origin_of(sites, g, "other launch")["kernel"] == "other launch"


def test_a_freed_function_does_not_lend_its_site_to_the_next_one():
    """Sites are keyed by the code object's id: the entry must keep the code alive, or a new function allocated at
    the freed one's address would be named after it."""
    sites = {}
    gc.freeze()         # the collections below then scan only this loop's objects, not the whole session's heap
    try:
        for i in range(200):
            fn = _generator(f"kernel_{i}", i % 3)
            g = fn()
            next(g)
            args = origin_of(sites, g, "launch")
            assert args["function"] == f"kernel_{i}" and args["source"] == f"<kernel_{i}>:{i % 3 + 2}"
            del fn, g
            gc.collect()
    finally:
        gc.unfreeze()


def test_a_finished_generator_is_named_by_its_kernel_alone():
    sites = {}
    g = _generator("k", 0)()
    list(g)
    assert origin_of(sites, g, "launch") == {"kernel": "launch"}


def _stage(ctx, x_t, x_gm):
    yield ctx.copy_gm_to_ub(x_t, x_gm[ctx.block_idx])     # MTE2 site


@kernel(cores="aiv")
def _nested(ctx, x_gm):
    x_t = ctx.ub.alloc((8, 64), "fp32")
    yield from _stage(ctx, x_t, x_gm)                     # kernel line of the MTE2 site
    yield ctx.vec.muls(x_t, x_t, 2.0)                     # VECTOR site


def _line(marker: str) -> str:
    """":N", the line of this file that ends with ``marker``."""
    for n, text in enumerate(open(__file__).read().splitlines(), 1):
        if text.endswith(marker):
            return f":{n}"
    raise AssertionError(marker)


def test_traced_slices_share_their_sites_args_and_name_the_helper_and_the_kernel_line():
    pod = Pod(cloudmatrix384(dies=1), trace=True)
    x = pod.alloc(0, (4, 8, 64), "fp32", phantom=True)
    run = pod.launch(_nested, aiv=4, args=(x,), numeric=False)
    vec = [s[6] for s in run.trace.slices if s[2] == "VECTOR"]
    assert len(vec) == 4 and all(a is vec[0] for a in vec)          # one dict per site, shared by the cores
    assert vec[0]["function"] == "_nested" and vec[0]["source"].endswith(_line("# VECTOR site"))
    mte2 = [s[6] for s in run.trace.slices if s[2] == "MTE2"]
    assert len(mte2) == 4
    assert mte2[0]["function"] == "_stage" and mte2[0]["source"].endswith(_line("# MTE2 site"))
    assert mte2[0]["kernel_source"].endswith(_line("# kernel line of the MTE2 site")) and mte2[0]["bytes"] == 8 * 64 * 4


def _helper(n: int):
    for i in range(n):
        yield ("helper", i)


def _mixed(n: int):
    """Own yields, ``yield from`` a helper, and own yields again: every way an instruction leaves a kernel."""
    for i in range(n):
        yield ("own", i)
        yield from _helper(2)
        if i % 2:
            yield ("odd", i)


def test_origin_at_gives_origin_of_s_dict_at_every_yield_of_every_generator():
    """The per-core cache (origin.Issuer) returns the very dict ``origin_of`` returns, across own yields, ``yield
    from`` helpers, a new generator on the same core, and kernels of other names sharing the sites."""
    from ascend_emu.origin import Issuer, origin_at
    cached, plain = {}, {}
    issuer = Issuer()
    seen = 0
    for kernel, n in (("a", 3), ("b", 2), ("a", 4)):
        g = _mixed(n)
        for _ in g:
            got = origin_at(issuer, cached, g, kernel)
            want = origin_of(plain, g, kernel)
            assert got == want and got is origin_of(cached, g, kernel)
            assert got is origin_at(issuer, cached, g, kernel)       # a hit: the same shared dict
            seen += 1
    assert seen == 10 + 7 + 14
