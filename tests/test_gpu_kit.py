"""The wheel kit's plan (``bench/gpu_kit.py``): what the GPU host lacks is carried, what it
has is left out and named. Building and importing the kit needs the package index; CI does
that after the suite (``.ci/run``)."""

from bench.gpu_kit import HOST_HAS, normalized, plan, wheel_name


def test_the_kit_carries_what_the_host_lacks_and_names_what_it_leaves_out():
    resolved = [("prefect", "3.9.1"), ("jax", "0.10.2"), ("pydantic-core", "2.41.5"), ("typing-extensions", "4.16.0")]
    carried, left_out = plan(resolved)
    assert carried == [("prefect", "3.9.1"), ("pydantic-core", "2.41.5")]
    assert left_out == [("jax", "0.10.2"), ("typing-extensions", "4.16.0")]
    assert "prefect" not in HOST_HAS and "pydantic" not in HOST_HAS  # what the host lacks, as its list says


def test_names_are_compared_as_pip_compares_them(tmp_path):
    assert normalized("Typing_Extensions") == normalized("typing.extensions") == "typing-extensions"
    assert wheel_name(tmp_path / "pydantic_core-2.41.5-cp312-cp312-manylinux_2_17_x86_64.whl") == "pydantic-core"
