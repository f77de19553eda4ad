"""docs/admin/jupyterhub.md: its complete jupyterhub_config.py loads as JupyterHub loads a config file, and its
caps reach each user's server environment as the guide says (issue 31 item 7)."""

import re
from pathlib import Path
from types import SimpleNamespace

from traitlets.config import Config

from gpu_quota_ext.hub.caps import HubGroup

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "admin" / "jupyterhub.md"


def complete_config() -> str:
    section = GUIDE.read_text().split("## A complete `jupyterhub_config.py`", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


def test_the_complete_config_loads_and_sets_the_spawn_hook():
    config = Config()
    exec(compile(complete_config(), "jupyterhub_config.py", "exec"), {"get_config": lambda: config})
    assert config.JupyterHub.spawner_class == "localprocess"
    assert callable(config.Spawner.pre_spawn_hook)
    groups = config.JupyterHub.load_groups
    assert groups["staff"]["users"] == ["alice"]


def test_the_guides_users_get_the_caps_it_says():
    """The hook the complete config sets, run on a spawner as JupyterHub would, gives each user the caps of
    their group (or their own entry): what step 4 of the guide checks on a real hub."""
    config = Config()
    exec(compile(complete_config(), "jupyterhub_config.py", "exec"), {"get_config": lambda: config})

    def spawned(name: str, group: str) -> dict:
        spawner = SimpleNamespace(user=SimpleNamespace(name=name, groups=[HubGroup(group)]), environment={})
        config.Spawner.pre_spawn_hook(spawner)
        return spawner.environment

    assert spawned("alice", "staff")["GPU_QUOTA_DEFAULT_CAP"] == "0.5"
    assert spawned("bob", "students")["GPU_QUOTA_MAX_CAP"] == "0.25"
    assert spawned("carol", "students")["GPU_QUOTA_MAX_CAP"] == "0.5"
    assert spawned("carol", "students")["GPU_QUOTA_ON_OVER_MAX"] == "refuse"


def test_the_versions_table_names_every_major_the_hub_extra_allows():
    from tests.hub.hub_versions import allowed_majors, hub_requirement

    text = GUIDE.read_text().split("## JupyterHub versions tested", 1)[1].split("\n## ", 1)[0]
    assert f"`{hub_requirement()}`" in text
    tested = {int(major) for major in re.findall(r"^\| (\d+)\.\d+\.\d+ \|", text, re.M)}
    assert tested == set(allowed_majors(hub_requirement())), text
