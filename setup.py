"""Package discovery for the kvpush namespace spread over the user's top-level folders.

pyproject.toml maps kvpush.services -> services/ and kvpush.connector -> connector/;
setuptools cannot discover subpackages under such a mapping on its own, so list them here.
"""

from setuptools import find_packages, setup


def _under(folder: str, prefix: str) -> list[str]:
    return [prefix] + [f"{prefix}.{name}" for name in find_packages(folder)]


setup(
    packages=find_packages(include=["kvpush", "kvpush.*"])
    + _under("services", "kvpush.services")
    + _under("connector", "kvpush.connector"),
    package_data={"kvpush": ["py.typed"]},
)
