"""Device profiles: pure and seeded; car connectivity and routes, phone charging/Wi-Fi windows."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.profiles import CarProfile, PhoneProfile, get_profile


def test_profiles_are_pure_and_seeded() -> None:
    times = np.linspace(0, 2 * 86400, 400)
    for name in ("car", "phone"):
        a, b, other = get_profile(name, seed=3), get_profile(name, seed=3), get_profile(name, seed=4)
        forward = [(a.online(t), a.can_update(t), tuple(a.next_mixture(t, 4))) for t in times]
        backward = [(b.online(t), b.can_update(t), tuple(b.next_mixture(t, 4))) for t in times[::-1]][::-1]
        assert forward == backward, f"{name}: answers depend on the order of questions"
        assert forward != [(other.online(t), other.can_update(t), tuple(other.next_mixture(t, 4))) for t in times]


def test_car_connectivity_and_route() -> None:
    car = CarProfile(seed=1, mean_online_s=600.0, mean_offline_s=60.0, area_mean_s=900.0)
    times = np.arange(0, 5 * 86400, 15.0)
    online = np.array([car.online(t) for t in times])
    assert abs(online.mean() - 600 / 660) < 0.03
    primaries = [car.primary_cluster(t, 4) for t in times]
    areas = [car.area(t) for t in times]
    steps = list(zip(areas, areas[1:], primaries, primaries[1:], strict=False))
    next_area = [(p, q) for a, b, p, q in steps if b == a + 1]
    assert next_area and all(p != q for p, q in next_area), "each new area has another primary cluster"
    assert abs(areas[-1] - 5 * 86400 / 900) < 0.15 * 5 * 86400 / 900
    alpha = car.next_mixture(1000.0, 4)
    assert alpha.sum() == pytest.approx(1.0) and alpha.max() == pytest.approx(car.primary_share)
    assert car.train_seconds(1000, 2) == pytest.approx(car.overhead_s + 2000 / car.samples_per_s)


def test_phone_updates_only_charging_on_wifi() -> None:
    phone = PhoneProfile(seed=2, start_hour=0.0)
    times = np.arange(0, 7 * 86400, 60.0)
    allowed = [t for t in times if phone.can_update(t)]
    assert allowed, "a phone must get some update windows in a week"
    assert all(phone.charging(t) and phone.on_wifi(t) and phone.online(t) for t in allowed)
    hours = {int(phone.hour_of_day(t)) for t in allowed}
    assert hours <= {21, 22, 23, 0, 1, 2, 3, 4, 5, 6, 7}
    assert not phone.can_update(14 * 3600.0)  # mid-afternoon: at work, not charging
    assert phone.place(3 * 3600) == "home" and phone.place(12 * 3600) == "work"
    assert phone.primary_cluster(3 * 3600, 4) != phone.primary_cluster(12 * 3600, 4)


def test_unknown_profile() -> None:
    with pytest.raises(ValueError, match="unknown device profile"):
        get_profile("tractor")
