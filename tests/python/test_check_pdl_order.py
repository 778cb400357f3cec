"""tools/check_pdl_order.py's reading of PTX and SASS (the ctest that runs it on the built CUDA
objects needs cuobjdump): a read-only load that the SASS has before ACQBULK and the PTX has
after griddepcontrol.wait is reported, and a kernel that never waits; a load the PTX has
before the wait too, or one after the wait in both, is not."""

import importlib.util
import os

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "check_pdl_order.py")
spec = importlib.util.spec_from_file_location("check_pdl_order", TOOL)
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

# cuobjdump's PTX: no indentation, inner braces at the line's start too.
PTX = """
.visible .entry moved(
.param .u64 moved_param_0
)
{
{
.reg .b32 %r<2>;
}
griddepcontrol.wait;
ld.global.nc.v2.u32 {%r1, %r2}, [%rd1];
ret;
}
.visible .entry kept(
.param .u64 kept_param_0
)
{
ld.global.nc.v2.u32 {%r1, %r2}, [%rd1];
griddepcontrol.wait;
ret;
}
.visible .entry after(
)
{
griddepcontrol.wait;
ld.global.nc.u32 %r1, [%rd1];
}
.visible .entry never(
)
{
ld.global.u32 %r1, [%rd1];
}
"""

SASS = """
        Function : moved
        /*0010*/                   LDG.E.64.CONSTANT R12, desc[UR6][R22.64] ;
        /*0020*/                   ACQBULK ;
        Function : kept
        /*0010*/                   LDG.E.64.CONSTANT R12, desc[UR6][R22.64] ;
        /*0020*/                   ACQBULK ;
        Function : after
        /*0010*/                   ACQBULK ;
        /*0020*/                   LDG.E.CONSTANT R12, desc[UR6][R22.64] ;
"""


def test_counts_read_only_loads_before_the_wait_in_ptx_and_sass():
    assert tool.ptx_loads_before_wait(PTX) == {"moved": 0, "kept": 1, "after": 0, "never": None}
    assert tool.sass_loads_before_wait(SASS) == {"moved": 1, "kept": 1, "after": 0}


def test_reports_the_load_that_ptxas_moved_above_the_wait_and_a_kernel_that_never_waits(
    monkeypatch,
):
    monkeypatch.setattr(tool, "dump", lambda tools, obj, what: PTX if what == "-ptx" else SASS)
    checked, bad = tool.check(["x.cu.o"], ("cuobjdump", "nvdisasm"))
    assert checked == 3  # "kept" loads before the wait by design: not checked
    assert len(bad) == 2
    assert bad[0].startswith("x.cu.o: moved: 1 read-only load")
    assert bad[1] == "x.cu.o: never: no griddepcontrol.wait in the PTX"
