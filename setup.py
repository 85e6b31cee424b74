"""Package discovery (the rest of the metadata is in pyproject.toml).

Every ``fastdet.*`` package under ``fastdet/`` is found by setuptools, so a new
subpackage ships without a list to keep up to date (a hand-kept list once left
``fastdet.convert`` out of the wheel). ``pipelines/`` and ``csrc/`` live at the top of
the tree and install as ``fastdet.pipelines`` and ``fastdet._csrc`` (pyproject's
``package-dir``); pyproject's ``packages.find`` cannot name a package by another path,
hence these two lines.
"""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["fastdet", "fastdet.*"]) + ["fastdet.pipelines", "fastdet._csrc"])
