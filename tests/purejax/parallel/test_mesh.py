"""purejax.parallel.mesh: building meshes, reading "dp=4,tp=2", and MeshAxes."""

import jax
import pytest

from purejax.parallel import DATA, MODEL, MeshAxes, make_mesh, parse_mesh


def test_make_mesh_names_the_axes_and_passes_their_types():
    mesh = make_mesh(1, 1)
    assert mesh.axis_names == (DATA, MODEL) and dict(mesh.shape) == {DATA: 1, MODEL: 1}
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2


def test_make_mesh_refuses_a_shape_that_does_not_cover_the_devices():
    with pytest.raises(ValueError, match=r"dp=4 x tp=2 = 8 devices, but 1 are given .*product is 1"):
        make_mesh(4, 2)
    with pytest.raises(ValueError, match="tp must be a positive int, got 0"):
        make_mesh(1, 0)


@pytest.mark.parametrize("text, sizes", [("dp=4,tp=2", (4, 2)), ("tp=8", (1, 8)), (" dp = 2 ", (2, 1)), ("", (1, 1))])
def test_parse_mesh(text, sizes):
    assert parse_mesh(text) == sizes


@pytest.mark.parametrize("text", ["dp=4,pp=2", "dp=0", "dp4", "tp=x"])
def test_parse_mesh_errors_name_the_bad_part(text):
    with pytest.raises(ValueError, match="expected e.g. 'dp=4,tp=2'"):
        parse_mesh(text)


def test_mesh_axes():
    assert MeshAxes.of(make_mesh(1, 1)) == MeshAxes()  # axes of size 1 are left out
    with pytest.raises(ValueError, match="which has 1 device on this mesh"):
        MeshAxes.of(make_mesh(1, 1), fsdp=True)  # never a silent fallback to unsharded params
    assert hash(MeshAxes(DATA, MODEL)) == hash(MeshAxes(DATA, MODEL))
    with pytest.raises(ValueError, match="fsdp=True splits params over the data axis"):
        MeshAxes(model=MODEL, fsdp=True)
    with pytest.raises(ValueError, match="must be different mesh axes"):
        MeshAxes(DATA, DATA)
