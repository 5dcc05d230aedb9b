"""scripts/uv_install.py: uv installs from where pip's configuration says packages come from
(uv reads none of it: without a machine's find-links it took the CUDA build of torch)."""
from __future__ import annotations

from scripts.uv_install import pip_settings, uv_options

LISTING = """\
:env:.find-links='/opt/wheels /srv/more wheels'
:env:.cert='/etc/ssl/company.pem'
global.extra-index-url='file:///opt/pypi/simple https://mirror.example/simple'
global.find-links='/ignored/by/the/variable'
global.index-url='https://global.example/simple'
install.index-url='https://install.example/simple'
install.no-index='yes'
global.constraint='/etc/xdg/pip/constraints.txt'
"""


def test_each_setting_is_taken_where_pip_takes_it():
    settings = pip_settings(LISTING)
    assert settings["find-links"] == "/opt/wheels /srv/more wheels"  # PIP_FIND_LINKS wins
    assert settings["index-url"] == "https://install.example/simple"  # install over global
    assert settings["extra-index-url"] == "file:///opt/pypi/simple https://mirror.example/simple"


def test_uv_is_told_what_pip_is():
    options, env = uv_options(pip_settings(LISTING))
    assert options == [
        "--native-tls", "--index-strategy", "unsafe-best-match",
        "--index-url", "https://install.example/simple",
        "--extra-index-url", "file:///opt/pypi/simple",
        "--extra-index-url", "https://mirror.example/simple",
        # split at whitespace, as pip splits it
        "--find-links", "/opt/wheels", "--find-links", "/srv/more", "--find-links", "wheels",
        "--no-index"]
    assert env == {"SSL_CERT_FILE": "/etc/ssl/company.pem"}


def test_without_a_configuration_uv_keeps_its_defaults():
    assert uv_options(pip_settings("")) == (
        ["--native-tls", "--index-strategy", "unsafe-best-match"], {})
