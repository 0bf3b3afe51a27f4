"""The collective counter the parallel tests judge by (hlo.py), on a hand-written HLO module: ops in nested
while loops count once per iteration of every enclosing loop, and replica groups, listed, in iota form or
named by mesh axis, give the mesh axes they span."""

from tests.purejax.parallel.hlo import executed_collectives

HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(%a, %b)
}

%inner (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %x = f32[4] get-tuple-element(%p), index=1
  %ar = f32[4]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  ROOT %t = (s32[], f32[4]) tuple(%i, %ar)
}

%outer (q: (s32[], f32[4])) -> (s32[], f32[4]) {
  %w = (s32[], f32[4]) while(%q), condition=%c, body=%inner, backend_config={"known_trip_count":{"n":"3"}}
  %rs = f32[2,2]{1,0} reduce-scatter(%y), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add
  ROOT %u = (s32[], f32[4]) tuple(%i, %v)
}

ENTRY %main (z: f32[4]) -> f32[4] {
  %w2 = (s32[], f32[4]) while(%t0), condition=%c2, body=%outer, backend_config={"known_trip_count":{"n":"5"}}
  %g = (f32[8], f32[3]) all-gather-start(%z, %z2), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}
  %n = f32[2]{0} all-reduce(%z3), channel_id=4, replica_groups=mesh['data'=4,'model'=2] {'data'}, to_apply=%add
  %gd = (f32[8], f32[3]) all-gather-done(%g)
  ROOT %r = f32[4] add(%z, %z)
}
"""


def test_nested_loops_multiply_and_groups_name_their_axes():
    got = executed_collectives(HLO, {"data": 4, "model": 2})
    assert got[("all-reduce", ("model",))] == {"ops": 15, "elements": 60}  # 3 x 5 runs of 4 elements
    assert got[("reduce-scatter", ("data",))] == {"ops": 5, "elements": 20}  # groups {0,2,4,6}, {1,3,5,7}
    assert got[("all-gather", ("data", "model"))] == {"ops": 1, "elements": 11}  # a tuple, counted by -start
    assert got[("all-reduce", ("data",))] == {"ops": 1, "elements": 2}  # the axes named (newer XLA)
    assert len(got) == 4
