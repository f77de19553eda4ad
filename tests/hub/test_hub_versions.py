"""tests/hub/hub_versions.py: which JupyterHub majors the real-hub tests run on, read from the [hub] extra."""

import pytest

from .hub_versions import allowed_majors, hub_requirement, requirements_for, runtime_requirements


def test_majors_of_a_range():
    assert allowed_majors("jupyterhub>=4.1,<7") == [4, 5, 6]
    assert allowed_majors("jupyterhub >= 5, < 6.0") == [5]
    assert allowed_majors("jupyterhub>=5.2,<6.1") == [5, 6]


def test_a_range_it_cannot_read_is_an_error_not_a_guess():
    for requirement in ("jupyterhub", "jupyterhub>=4", "jupyterhub<7,>=4", "jupyterhub~=4.1"):
        with pytest.raises(ValueError, match="reads only"):
            allowed_majors(requirement)


def test_each_environment_is_the_extras_jupyterhub_narrowed_to_one_major_plus_the_packages_dependencies():
    majors = allowed_majors(hub_requirement())
    assert majors, hub_requirement()
    for major in majors:
        jupyterhub, *rest = requirements_for(major)
        assert jupyterhub == f"{hub_requirement()},=={major}.*"
        assert rest == runtime_requirements() and any(r.startswith("jupyter_server") for r in rest)
