"""The arenas running kernels keep after a fast resume are host memory the server can take back: which ones a park
that finds the host short asks for (path.arenas_to_release), and by how much a park is short
(HostAccount.short_by), pure."""

from gpu_quota_ext.parking.host_account import HostAccount, HostReading
from gpu_quota_ext.parking.path import arenas_to_release

GiB = 1 << 30
MARGIN = 2 * GiB


def test_the_largest_arenas_first_and_only_as_many_as_cover_what_is_short():
    kept = {"a": 20 * GiB, "b": 56 * GiB, "c": 30 * GiB}
    assert arenas_to_release(kept, 25 * GiB) == ("b",)
    assert arenas_to_release(kept, 60 * GiB) == ("b", "c")
    assert arenas_to_release(kept, 106 * GiB) == ("b", "c", "a")


def test_nothing_is_given_back_when_nothing_is_short_or_all_of_it_would_not_do():
    kept = {"a": 20 * GiB}
    assert arenas_to_release(kept, 0) == ()
    assert arenas_to_release(kept, -5) == ()
    assert arenas_to_release(kept, 21 * GiB) == ()  # the park is refused all the same: keep the pinning
    assert arenas_to_release({}, GiB) == ()


def test_ties_are_broken_by_name_so_the_choice_is_the_same_every_time():
    assert arenas_to_release({"y": GiB, "x": GiB}, GiB) == ("x",)


def test_short_by_is_what_the_refusal_lacks_on_the_tighter_of_host_and_cgroup():
    account = HostAccount().promise("other", 10 * GiB)  # a park under way still brings 10 GiB
    reading = HostReading(available=40 * GiB, cgroup_room=30 * GiB)
    # 30 GiB of cgroup room - 10 coming = 20 left; 25 + 2 margin needed: 7 GiB short.
    assert account.short_by(25 * GiB, reading, MARGIN) == 7 * GiB
    assert account.refusal("k", 25 * GiB, reading, MARGIN) is not None
    assert account.short_by(18 * GiB, reading, MARGIN) == 0
    assert account.refusal("k", 18 * GiB, reading, MARGIN) is None
    assert HostAccount().short_by(GiB, HostReading(), MARGIN) == 0  # unknown memory: the refusal says nothing either
