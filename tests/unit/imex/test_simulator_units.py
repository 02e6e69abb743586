"""Pure parts of the IMEX simulator: SIGUSR1 rate limit with a fake clock, fault specs, settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from imex.host_check import ImexState
from tests.testbed.imex_simulator.daemon import ReResolveLimiter, Settings
from tests.testbed.imex_simulator.faults import Faults, FaultSpecError, read_faults


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_sigusr1_honoured_at_most_once_per_interval() -> None:
    clock = FakeClock()
    limiter = ReResolveLimiter(5.0, clock)
    assert limiter.allow() is True
    clock.now += 1.0
    assert limiter.allow() is False
    clock.now += 3.9
    assert limiter.allow() is False
    clock.now += 0.1  # 5.0 s after the honoured one
    assert limiter.allow() is True
    clock.now += 4.99
    assert limiter.allow() is False


def test_dropped_signals_do_not_extend_the_window() -> None:
    """IMEX drops repeats; it does not restart its timer on them."""
    clock = FakeClock()
    limiter = ReResolveLimiter(5.0, clock)
    assert limiter.allow()
    for _ in range(4):
        clock.now += 1.0
        assert not limiter.allow()
    clock.now += 1.0
    assert limiter.allow()


def test_fault_parsing() -> None:
    faults = Faults.parse("stall, refuse-peers\nforce-state=WAITING_FOR_PEERS startup-delay=1.5 # comment")
    assert faults == Faults(stall=True, refuse_peers=True, force_state=ImexState.WAITING_FOR_PEERS, startup_delay_s=1.5)
    assert Faults.parse("") == Faults()


@pytest.mark.parametrize("spec", ["explode", "force-state=SLEEPY", "startup-delay=soon"])
def test_bad_fault_specs(spec: str) -> None:
    with pytest.raises(FaultSpecError):
        Faults.parse(spec)


def test_fault_file_wins_over_env_while_it_exists(tmp_path: Path) -> None:
    path = tmp_path / "faults"
    assert read_faults("stall", path) == Faults(stall=True)
    path.write_text("hold-shutdown\n")
    assert read_faults("stall", path) == Faults(hold_shutdown=True)
    path.write_text("")
    assert read_faults("stall", path) == Faults()


def test_settings_from_env() -> None:
    settings = Settings.from_env(
        {"IMEX_SIM_HOSTS_FILE": "/tmp/h", "IMEX_SIM_SIGUSR1_INTERVAL": "0.5", "IMEX_SIM_FAULT_FILE": "/tmp/f"}
    )
    assert settings.hosts_file == Path("/tmp/h")
    assert settings.sigusr1_interval_s == 0.5
    assert settings.fault_file == Path("/tmp/f")
    assert Settings.from_env({}).sigusr1_interval_s == 5.0
    assert Settings.from_env({}).hosts_file == Path("/etc/hosts")
