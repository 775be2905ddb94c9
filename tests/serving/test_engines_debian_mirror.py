"""The Debian mirror the engine image's root file system comes from: apt's own sources or
BERTH_DEBIAN_MIRROR, never a built-in address. Each test writes its own apt directory."""

from __future__ import annotations

import pytest

from serving.engines.llamacpp_image import ImageBuildError, debian_mirror


@pytest.fixture
def apt_dir(tmp_path, monkeypatch):
    """An empty apt configuration directory (with sources.list.d/), and no explicit setting."""
    monkeypatch.delenv("BERTH_DEBIAN_MIRROR", raising=False)
    (tmp_path / "apt" / "sources.list.d").mkdir(parents=True)
    return tmp_path / "apt"


def test_one_line_sources_list_gives_the_suites_own_mirror(apt_dir):
    (apt_dir / "sources.list").write_text(
        "# deb http://commented.example/debian bookworm main\n"
        "deb http://security.example/debian-security bookworm-security main\n"
        "deb-src http://sources.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
        "http://mirror.example/debian bookworm main contrib  # the site's mirror\n"
        "deb http://later.example/debian bookworm main\n")

    assert debian_mirror(apt_dir) == "http://mirror.example/debian"


def test_deb822_sources_skip_disabled_stanzas_and_read_folded_fields(apt_dir):
    (apt_dir / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n"
        "URIs: http://security.example/debian-security\n"
        "Suites: bookworm-security\n"
        "Components: main\n"
        "\n"
        "Types: deb\n"
        "URIs: http://disabled.example/debian\n"
        "Suites: bookworm\n"
        "Enabled: no\n"
        "\n"
        "# the site's mirror\n"
        "types: deb-src deb\n"
        "URIs: mirror+file:/etc/apt/mirrors.txt\n"
        "  https://mirror.example/debian/\n"
        "Suites: bookworm-updates\n"
        "  bookworm\n"
        "Components: main\n")

    assert debian_mirror(apt_dir) == "https://mirror.example/debian/"


def test_sources_are_read_in_apts_order_and_other_file_names_are_ignored(apt_dir):
    parts = apt_dir / "sources.list.d"
    (parts / "00-old.list.disabled").write_text("deb http://disabled.example/debian bookworm main\n")
    (parts / "10-site.sources").write_text("Types: deb\nURIs: http://ten.example/debian\nSuites: bookworm\n")
    (parts / "20-other.list").write_text("deb http://twenty.example/debian bookworm main\n")
    (apt_dir / "sources.list").write_text("deb http://archive.ubuntu.example/ubuntu jammy main\n")

    assert debian_mirror(apt_dir) == "http://ten.example/debian"

    (apt_dir / "sources.list").write_text("deb file:///srv/debian bookworm main\n")
    assert debian_mirror(apt_dir) == "file:///srv/debian"  # sources.list comes first


def test_the_setting_wins_over_apts_sources(apt_dir, monkeypatch):
    (apt_dir / "sources.list").write_text("deb http://mirror.example/debian bookworm main\n")
    monkeypatch.setenv("BERTH_DEBIAN_MIRROR", "http://chosen.example/debian")

    assert debian_mirror(apt_dir) == "http://chosen.example/debian"


def test_a_setting_that_is_no_address_is_refused_naming_it(apt_dir, monkeypatch):
    monkeypatch.setenv("BERTH_DEBIAN_MIRROR", "deb.debian.org/debian")

    with pytest.raises(ImageBuildError, match=r"BERTH_DEBIAN_MIRROR='deb.debian.org/debian' is not an http://"):
        debian_mirror(apt_dir)


def test_without_a_source_for_the_suite_the_error_says_what_to_set(apt_dir):
    (apt_dir / "sources.list").write_text(
        "deb http://archive.ubuntu.example/ubuntu jammy main\n"
        "deb cdrom:[Debian 12]/ bookworm main\n")  # debootstrap cannot fetch from a cdrom: source

    with pytest.raises(ImageBuildError) as failure:
        debian_mirror(apt_dir)

    assert failure.value.step == "rootfs"
    assert "no Debian mirror for bookworm" in str(failure.value)
    assert str(apt_dir) in str(failure.value)
    assert "set BERTH_DEBIAN_MIRROR" in str(failure.value)


def test_a_machine_without_apt_sources_gets_the_same_error(tmp_path, monkeypatch):
    monkeypatch.delenv("BERTH_DEBIAN_MIRROR", raising=False)

    with pytest.raises(ImageBuildError, match="set BERTH_DEBIAN_MIRROR"):
        debian_mirror(tmp_path / "no-apt-here")
