"""nsbox.write_name_files: the /etc/hosts, /etc/hostname and /etc/resolv.conf that a
namespace sandbox's root gets, as Podman writes them into every container."""

from __future__ import annotations

from pathlib import Path

from swectl.remote.programs.nsbox import write_name_files


def hosts_names(root: Path) -> dict[str, str]:
    names = {}
    for line in (root / "etc" / "hosts").read_text().splitlines():
        fields = line.split("#")[0].split()
        for name in fields[1:]:
            names.setdefault(name, fields[0])
    return names


def test_a_root_without_hosts_gets_localhost_and_its_hostname(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    write_name_files(str(tmp_path), "box1", network=False)
    names = hosts_names(tmp_path)
    assert names["localhost"] == "127.0.0.1" and names["box1"] == "127.0.0.1"
    assert names["ip6-localhost"] == "::1"
    assert (tmp_path / "etc" / "hostname").read_text() == "box1\n"
    # no network: a nameserver where nothing answers, so a lookup fails at once
    assert (tmp_path / "etc" / "resolv.conf").read_text().splitlines()[-1] == "nameserver 127.0.0.1"


def test_the_images_own_lines_are_kept_and_not_repeated(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    own = "127.0.0.1 localhost\n10.1.2.3 db.internal # the image's\n"
    (tmp_path / "etc" / "hosts").write_text(own)
    write_name_files(str(tmp_path), "box2", network=False)
    text = (tmp_path / "etc" / "hosts").read_text()
    assert text.count("localhost") == 1 and "10.1.2.3 db.internal" in text
    assert hosts_names(tmp_path)["box2"] == "127.0.0.1"


def test_symlinks_never_lead_outside_the_root(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_text("host file\n")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hosts").symlink_to(outside)
    (root / "etc" / "hostname").symlink_to(outside)
    write_name_files(str(root), "box3", network=False)
    assert outside.read_text() == "host file\n"
    assert not (root / "etc" / "hosts").is_symlink() and "box3" in hosts_names(root)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "etc").symlink_to(outside.parent)  # an /etc that is a symlink is left alone
    write_name_files(str(linked), "box4", network=False)
    assert not (tmp_path / "hosts").exists() and not (tmp_path / "hostname").exists()


def test_with_the_network_the_nodes_resolver_is_copied(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    write_name_files(str(tmp_path), "box5", network=True)
    if Path("/etc/resolv.conf").is_file():
        assert (tmp_path / "etc" / "resolv.conf").read_text() == Path("/etc/resolv.conf").read_text()
