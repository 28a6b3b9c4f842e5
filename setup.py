"""Package discovery only (everything else is in pyproject.toml).

The design card fixes the top-level folders `actors/` and `remote/`; they install as `swectl.actors` and
`swectl.remote` (see `package-dir` in pyproject.toml), a remapping that `[tool.setuptools.packages.find]` cannot
express. Subpackages are found, never listed, so a new folder cannot be left out of the wheel.
"""

from setuptools import find_namespace_packages, setup


def packages_under(name: str, folder: str) -> list[str]:
    found = find_namespace_packages(folder, exclude=["*__pycache__*"])
    return [name, *(f"{name}.{sub}" for sub in found)]


setup(packages=[*packages_under("swectl", "swectl"), *packages_under("swectl.actors", "actors"),
                *packages_under("swectl.remote", "remote")])
