"""Package discovery for hlbp's flat layout: the folders ``peer/``, ``protocol/``, ``cli/`` and ``bootstrap/``
import as ``hlbp.peer`` and so on.

setuptools' declarative discovery cannot add the ``hlbp.`` prefix to folders found at the top level, and a
hand-kept list drifted once (a wheel without ``hlbp.peer.swarm``). So the list is computed here from the folders
themselves; everything else about the project stays in pyproject.toml.
"""

from setuptools import find_packages, setup

TOP_LEVEL = ("peer", "protocol", "cli", "bootstrap")


def _packages() -> list[str]:
    """Every folder under the four top-level folders that holds an ``__init__.py``, named as it imports."""
    packages = []
    for top in TOP_LEVEL:
        packages.append(f"hlbp.{top}")
        packages.extend(f"hlbp.{top}.{sub}" for sub in find_packages(where=top))
    return packages


setup(packages=_packages(), package_dir={f"hlbp.{top}": top for top in TOP_LEVEL})
