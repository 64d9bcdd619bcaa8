"""bert_jax.pod.planning.hlo: the collectives of compiled programs (8 CPU devices) against what the
mesh and the shapes say they must be, and hand-written HLO in the forms the CPU compiler does not
print (explicit and iota replica groups, async start/done pairs, tuples, nested loops); and
bert_jax.pod.planning.traffic's memory traffic of hand-written and compiled programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bert_jax.pod.planning import hlo, traffic


def as_sets(groups):
    return {frozenset(g) for g in groups}


def mesh_groups(mesh, axis):
    """Positions (= the program's device ids) of the devices that share every other mesh coordinate."""
    pos = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    i = mesh.axis_names.index(axis)
    return as_sets(np.moveaxis(pos, i, -1).reshape(-1, pos.shape[i]).tolist())


def test_fsdp_gather_and_data_reduction_of_a_compiled_step():
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    w = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", None)))
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P(("data", "fsdp"), None)))

    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)

    text = jax.jit(step, out_shardings=NamedSharding(mesh, P("fsdp", None))).lower(w, x).compile().as_text()
    found = hlo.collectives(text)
    gathers = [c for c in found if c.kind == "all-gather"]
    # FSDP: the weight gathered whole over the fsdp axis, once.
    assert len(gathers) == 1 and gathers[0].bytes == 256 * 512 * 4 and gathers[0].executions == 1
    assert as_sets(gathers[0].groups) == mesh_groups(mesh, "fsdp")
    # The gradient reduced over both axes (all-reduce or reduce-scatter, however XLA splits it):
    # every group of every reduction lies within one fsdp or one data group.
    reductions = [c for c in found if c.kind in ("all-reduce", "reduce-scatter")]
    assert reductions
    allowed = mesh_groups(mesh, "fsdp") | mesh_groups(mesh, "data")
    for c in reductions:
        assert as_sets(c.groups) <= allowed
    axes = {("fsdp" if as_sets(c.groups) <= mesh_groups(mesh, "fsdp") else "data") for c in reductions}
    assert axes == {"fsdp", "data"}


def test_scan_multiplies_by_the_trip_count():
    mesh = jax.make_mesh((8,), ("data",))
    xs = jax.ShapeDtypeStruct((5, 16, 32), jnp.float32, sharding=NamedSharding(mesh, P(None, "data", None)))

    def f(xs):
        def body(carry, x):
            return carry + jnp.sum(x, axis=0), None  # a sum over the sharded rows: one all-reduce per step
        return jax.lax.scan(body, jnp.zeros(32), xs)[0]

    found = hlo.collectives(jax.jit(f).lower(xs).compile().as_text())
    reduces = [c for c in found if c.kind == "all-reduce"]
    assert sum(c.executions for c in reduces) == 5
    assert all(c.bytes == 32 * 4 and as_sets(c.groups) == {frozenset(range(8))} for c in reduces)
    assert hlo.summarize(found)["all-reduce"]["bytes"] == 5 * 32 * 4


HAND = """HloModule m, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%inner_body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]{0}) parameter(0)
  %v = f32[64]{0} get-tuple-element(%p), index=1
  %cp-start = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%v), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cp-done = f32[64]{0} collective-permute-done(%cp-start)
  ROOT %t = (s32[], f32[64]{0}) tuple(%i, %cp-done)
}

%inner_cond (p: (s32[], f32[64])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%outer_body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]{0}) parameter(0)
  %w = (s32[], f32[64]{0}) while(%p), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  %x = f32[64]{0} get-tuple-element(%w), index=1
  %ar = (f32[64]{0}, bf16[10,10]{1,0}) all-reduce(%x, %y), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true, to_apply=%add
  ROOT %t = (s32[], f32[64]{0}) tuple(%i, %x)
}

%br0 (x: f32[64]) -> f32[64] {
  ROOT %x = f32[64]{0} parameter(0)
}

%br1 (x: f32[64]) -> f32[64] {
  %x = f32[64]{0} parameter(0)
  ROOT %guarded = f32[64]{0} all-reduce(%x), channel_id=5, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
}

%counted_cond (p: (u32[], f32[64])) -> pred[] {
  %k = u32[]{:T(128)} constant(6), metadata={op_name="windowed"}
  %p = (u32[], f32[64]{0}) parameter(0)
  %g = u32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%g, %k), direction=LT, metadata={op_name="windowed"}
}

%counted_body (p: (u32[], f32[64])) -> (u32[], f32[64]) {
  %p = (u32[], f32[64]{0}) parameter(0)
  %v = f32[64]{0} get-tuple-element(%p), index=1
  %chunk = f32[64]{0} all-gather(%v), channel_id=6, replica_groups=[1,8]<=[8], dimensions={0}
  %sunk = f32[512]{0} all-gather(%v), channel_id=7, replica_groups=[1,8]<=[8], dimensions={0}, frontend_attributes={chain_id="1"}
  ROOT %t = (u32[], f32[64]{0}) tuple(%i, %chunk)
}

%outer_cond (p: (s32[], f32[64])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[64], g: bf16[4,128]) -> f32[64] {
  %a = f32[64]{0} parameter(0)
  %g = bf16[4,128]{1,0:T(8,128)(2,1)} parameter(1)
  %ag-start = ((bf16[4,128]{1,0}), bf16[16,128]{1,0}) all-gather-start(%g), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %ag-done = bf16[16,128]{1,0} all-gather-done(%ag-start)
  %sunk.0 = f32[512]{0} all-gather(%a), channel_id=8, replica_groups=[1,8]<=[8], dimensions={0}, frontend_attributes={chain_id="1"}
  %rs = f32[8]{0} reduce-scatter(%a), channel_id=3, replica_groups={}, dimensions={0}, to_apply=%add
  %w = (s32[], f32[64]{0}) while(%t0), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"24"}}
  %w2 = (s32[], f32[64]{0}) while(%t1), condition=%outer_cond, body=%outer_body
  %cnd = f32[64]{0} conditional(%i0, %a, %a), branch_computations={%br0, %br1}
  %w3 = (u32[], f32[64]{0}) while(%t3), condition=%counted_cond, body=%counted_body
  ROOT %r = f32[64]{0} get-tuple-element(%w), index=1
}
"""


def test_hand_written_forms():
    found = {c.name: c for c in hlo.collectives(HAND)}
    assert set(found) == {"ag-done", "rs", "ar", "cp-done", "guarded", "chunk", "sunk (chain 1: 2 pieces)"}
    # a chain (two async pieces of one gather, one of them in the chunk loop): one collective, once
    sunk = found["sunk (chain 1: 2 pieces)"]
    assert (sunk.executions, sunk.bytes) == (1, 512 * 4)
    chunk = found["chunk"]  # a collective-matmul-style loop: no trip count, `counter < 6`
    assert chunk.executions == 6 and not chunk.unknown_trip_count and chunk.group_size == 8
    guarded = found["guarded"]  # in a conditional branch: counted as run, flagged
    assert guarded.conditional and guarded.executions == 1 and guarded.group_size == 2
    assert not found["ag-done"].conditional
    ag = found["ag-done"]  # the done op's result, the start op's explicit groups
    assert (ag.kind, ag.bytes, ag.groups, ag.executions) == ("all-gather", 16 * 128 * 2,
                                                             [[0, 1, 2, 3], [4, 5, 6, 7]], 1)
    rs = found["rs"]  # {} = every device; full buffer = shard x 8
    assert (rs.bytes, rs.full_bytes, rs.groups) == (32, 256, [list(range(8))])
    ar = found["ar"]  # iota groups: arange(8).reshape(4,2).T -> rows [0,2,4,6], [1,3,5,7]; tuple bytes summed
    assert ar.groups == [[0, 2, 4, 6], [1, 3, 5, 7]] and ar.bytes == 64 * 4 + 100 * 2 and ar.elements == 164
    # outer loops: 24 + 1 (no trip count: counted once, flagged)
    assert ar.executions == 25 and ar.unknown_trip_count
    cp = found["cp-done"]  # nested: 3 per outer iteration
    assert cp.kind == "collective-permute" and cp.executions == 75 and cp.groups == [[0, 1], [1, 2], [2, 3], [3, 0]]
    assert cp.bytes == 64 * 4


def test_mesh_form_with_device_ids():
    attrs = ("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, "
             "dimensions={0}")
    # devices: arange(8).reshape(2,4).T.ravel() = [0,4,1,5,2,6,3,7] laid on (4,1,2); groups vary axis_0
    assert hlo.parse_groups(attrs, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hlo.parse_groups("replica_groups=mesh['x'=2,'y'=4] {'x','y'}", 8) == [list(range(8))]
    # ids listed: laid on the mesh in that order
    listed = "replica_groups=mesh['x'=2,'y'=2], device_ids=[3,1,2,0] {'y'}"
    assert hlo.parse_groups(listed, 4) == [[3, 1], [2, 0]]
    assert hlo.parse_groups("replica_groups=mesh['x'=2,'y'=2], device_ids=[2,2] {'x'}", 4) == [[0, 2], [1, 3]]
    assert hlo.parse_groups("replica_groups=mesh['x'=2,'y'=4] {'x'}", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("text,expected", [("f32[2,3]{1,0}", 24), ("bf16[]", 2), ("pred[7]", 7),
                                           ("(f32[2]{0}, s32[])", 12), ("f8e4m3fn[16]", 16),
                                           ("bf16[8,128]{1,0:T(8,128)(2,1)}", 2048)])
def test_type_bytes(text, expected):
    assert hlo.type_bytes(text) == expected


TRAFFIC = """HloModule t, is_scheduled=true

%neg (p: f32[64]) -> f32[64] {
  %p = f32[64]{0} parameter(0)
  ROOT %n = f32[64]{0} negate(%p)
}

%relayout (w: f32[5,64]) -> f32[5,64] {
  %w = f32[5,64]{1,0} parameter(0)
  ROOT %c = f32[5,64]{0,1} copy(%w)
}

%layer_weights (w: f32[5,64], i: s32[]) -> f32[64] {
  %w = f32[5,64]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  %b = f32[5,64]{1,0} bitcast(%w)
  %r = f32[5,64]{0,1} fusion(%b), kind=kLoop, calls=%relayout
  %ds = f32[1,64]{0,1} dynamic-slice(%r, %i, %z), dynamic_slice_sizes={1,64}
  ROOT %out = f32[64]{0} bitcast(%ds)
}

%pick (acts: bf16[5,64], i: s32[]) -> bf16[1,64] {
  %acts = bf16[5,64]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = bf16[1,64]{1,0} dynamic-slice(%acts, %i, %z), dynamic_slice_sizes={1,64}
}

%pick_and_scale (acts: bf16[5,64], i: s32[]) -> bf16[1,64] {
  %acts = bf16[5,64]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %row = bf16[1,64]{1,0} fusion(%acts, %i), kind=kLoop, calls=%pick
  ROOT %twice = bf16[1,64]{1,0} add(%row, %row)
}

%save (acts: bf16[5,64], x: bf16[1,64], i: s32[]) -> bf16[5,64] {
  %acts = bf16[5,64]{1,0} parameter(0)
  %x = bf16[1,64]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = bf16[5,64]{1,0} dynamic-update-slice(%acts, %x, %i, %z)
}

%body (p: (s32[], f32[64], f32[5,64])) -> (s32[], f32[64], f32[5,64]) {
  %p = (s32[], f32[64]{0}, f32[5,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[64]{0} get-tuple-element(%p), index=1
  %w = f32[5,64]{1,0} get-tuple-element(%p), index=2
  %f = f32[64]{0:S(3)} fusion(%v), kind=kLoop, calls=%neg
  %lw = f32[64]{0} fusion(%w, %i), kind=kLoop, calls=%layer_weights
  %ar = f32[64]{0} all-reduce(%lw), channel_id=1, replica_groups={}, to_apply=%neg
  ROOT %t = (s32[], f32[64]{0}, f32[5,64]{1,0}) tuple(%i, %f, %w)
}

%cond (p: (s32[], f32[64], f32[5,64])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%chunk_cond (p: (u32[], bf16[32])) -> pred[] {
  %k = u32[]{:T(128)} constant(4)
  %p = (u32[], bf16[32]{0}) parameter(0)
  %g = u32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%g, %k), direction=LT
}

%chunk_body (p: (u32[], bf16[32])) -> (u32[], bf16[32]) {
  %p = (u32[], bf16[32]{0}) parameter(0)
  %g = u32[] get-tuple-element(%p), index=0
  %x = bf16[32]{0} get-tuple-element(%p), index=1
  %m = bf16[32]{0} multiply(%x, %x)
  ROOT %t = (u32[], bf16[32]{0}) tuple(%g, %m)
}

%skip (x: f32[64]) -> f32[64] {
  ROOT %x = f32[64]{0} parameter(0)
}

%update (x: f32[64]) -> f32[64] {
  %x = f32[64]{0} parameter(0)
  ROOT %y = f32[64]{0} exponential(%x)
}

%called (a: f32[16]) -> f32[16] {
  %a = f32[16]{0} parameter(0)
  ROOT %z = f32[16]{0} add(%a, %a)
}

ENTRY %main (a: f32[256], t0: (s32[], f32[64], f32[5,64]), t1: (u32[], bf16[32]), q: f32[16], acts: bf16[5,64], x: bf16[1,64], i: s32[]) -> f32[64] {
  %a = f32[256]{0} parameter(0)
  %t0 = (s32[], f32[64]{0}, f32[5,64]{1,0}) parameter(1)
  %t1 = (u32[], bf16[32]{0}) parameter(2)
  %q = f32[16]{0} parameter(3)
  %acts = bf16[5,64]{1,0} parameter(4)
  %x = bf16[1,64]{1,0} parameter(5)
  %i = s32[] parameter(6)
  %buf = f32[4096]{0} custom-call(), custom_call_target="AllocateBuffer"
  %cs = (f32[256]{0}, f32[256]{0:S(3)}, u32[]{:S(2)}) copy-start(%a)
  %cd = f32[256]{0:S(3)} copy-done(%cs)
  %e = bf16[256]{0} convert(%cd)
  %s1 = f32[8]{0:S(1)} slice(%a), slice={[0:8]}
  %saved = bf16[5,64]{1,0} fusion(%acts, %x, %i), kind=kLoop, calls=%save
  %row = bf16[1,64]{1,0} fusion(%acts, %i), kind=kLoop, calls=%pick_and_scale
  %w = (s32[], f32[64]{0}, f32[5,64]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %w2 = (u32[], bf16[32]{0}) while(%t1), condition=%chunk_cond, body=%chunk_body
  %v = f32[64]{0} get-tuple-element(%w), index=1
  %cnd = f32[64]{0} conditional(%i, %v, %v), branch_computations={%skip, %update}
  %c = f32[16]{0} call(%q), to_apply=%called
  ROOT %r = f32[64]{0} get-tuple-element(%w), index=1
}
"""


def test_memory_traffic_hand_computed():
    t = traffic.memory_traffic(TRAFFIC)
    copies = 256 * 4  # copy-start/done of a: one HBM -> CMEM move
    hbm = (256 * 2  # convert: reads the CMEM copy (counted on chip), writes bf16 to HBM
           + 8 * 4  # slice: reads the 8 floats it returns, not the whole array (its result is in S(1))
           + 2 * 64 + 4  # save fusion, a dynamic-update-slice in place: reads the update and the index,
           + 2 * 64  # not the buffer, and writes the update's bytes
           + 2 * 64 + 4 + 2 * 64  # a row sliced in a nested fusion: the row and the index read, a row written
           + 5 * (64 * 4  # loop body x5: %f reads v (HBM)
                  + 64 * 4 + 4 + 64 * 4)  # %lw: one 64-float slice of the stacked weights (through a
                  # bitcast and a nested relayout fusion, which XLA computes only where sliced), the
                  # index, 64 floats out
           + 4 * 3 * 64  # the chunk loop's bound read off its condition: 4 trips of a bf16[32] multiply
           + 5 * (4 + 4 + 1)  # its condition, run 5 times: compare two u32 -> pred
           + 2 * 64 * 4  # the conditional's costlier branch (exponential), not the pass-through
           + 3 * 16 * 4)  # the call's add: two operands and the result
    assert t.copies == copies
    assert t.by_space[0] == hbm
    assert t.hbm == hbm + copies
    # On chip: the CMEM copy read by the convert, the loop's S(3) outputs, the S(1) slice.
    assert t.by_space[3] == 256 * 4 + 5 * 64 * 4
    assert t.by_space[1] == 8 * 4
    assert t.on_chip == t.by_space[3] + t.by_space[1]
    # The all-reduce (left to the network term) and the reserved buffer (AllocateBuffer) moved
    # nothing here; the loop counts 5 trips:
    # the same program with 10 trips adds five more bodies.
    ten = traffic.memory_traffic(TRAFFIC.replace('"n":"5"', '"n":"10"'))
    assert ten.by_space[0] - t.by_space[0] == 5 * (64 * 4 + 64 * 4 + 4 + 64 * 4)


def test_memory_traffic_of_compiled_programs():
    """An elementwise op reads and writes its array once; a scan's traffic grows by one body per step."""
    x = jnp.ones(1000, jnp.float32)
    assert traffic.memory_traffic(jax.jit(jnp.sin).lower(x).compile().as_text()).hbm == 2 * 4000

    def scanned(n):
        def f(c, xs):
            return jax.lax.scan(lambda c, x: (jnp.sin(c) * x, None), c, xs)[0]
        return traffic.memory_traffic(jax.jit(f).lower(x, jnp.ones((n, 1000))).compile().as_text()).hbm

    a, b, c = scanned(20), scanned(40), scanned(60)
    assert b - a == c - b > 0
    # ... and per step at least the carry and one row of xs are read and the carry written.
    assert (b - a) / 20 >= 3 * 4000


# A Pallas kernel's custom call prints its backend_config over several lines, some starting with
# "}}" (splash attention's on TPU): the rest of the computation (here the gradient all-reduce and
# a copy after it) still belongs to it.
MULTILINE = """HloModule k, is_scheduled=true, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]{0}) parameter(0)
  %v = f32[256]{0} get-tuple-element(%p), index=1
  %k = f32[256]{0} custom-call(%v), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "TUxJUgA=",
"xprof_metadata":"{\\"block_q\\": 512}"
}}, metadata={op_name="splash"}
  %ar = f32[256]{0} all-reduce(%k), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  %c = f32[256]{0:S(1)} copy(%ar)
  ROOT %t = (s32[], f32[256]{0}) tuple(%i, %c)
}

%cond (p: (s32[], f32[256])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[256]) -> f32[256] {
  %a = f32[256]{0} parameter(0)
  %w = (s32[], f32[256]{0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"24"}}
  ROOT %r = f32[256]{0} get-tuple-element(%w), index=1
}
"""


def test_a_kernel_config_over_several_lines_does_not_end_its_computation():
    (ar,) = hlo.collectives(MULTILINE)
    assert (ar.name, ar.executions, ar.bytes) == ("ar", 24, 256 * 4)
    comps, entry, devices = hlo.computations(MULTILINE)
    assert (entry, devices) == ("main", 4)
    assert [line.split("=")[0].strip().lstrip("%") for line in comps["body"]] == ["p", "v", "k", "ar", "c", "ROOT %t"]
    assert '"xprof_metadata"' in comps["body"][2] and comps["body"][2].endswith('metadata={op_name="splash"}')
