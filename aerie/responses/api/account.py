"""A provider account's usage as OpenRouter reports it: ``GET /key`` (usage, limit, limit_remaining), else
``GET /credits`` (total_usage). Account-wide and seconds late (../shared/notes/openrouter.md): it counts every use of
the key, which is why a results folder's books are attributed key-wide (aerie.responses.api.key_books), never read
off the account's growth alone.

Parse time imports this (the cost preview): ``requests`` is imported only when the account is read.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AccountReading:
    usage: float  # USD billed on the key so far
    limit: float | None
    limit_remaining: float | None
    endpoint: str  # "key" or "credits"


def read_account_usage(
    base_url: str, api_key: str | None, key_variable: str, timeout: float = 15.0
) -> AccountReading | None:
    """The account's live usage; None when neither endpoint gives a figure. Raises RuntimeError when the server is
    unreachable or refuses the key (``key_variable`` names where the key came from, never the key)."""
    import requests

    base = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = requests.get(f"{base}/key", headers=headers, timeout=timeout)
        if resp.status_code == 401:
            raise RuntimeError(f"the API key in ${key_variable} was refused (HTTP 401)")
        data = (resp.json().get("data") or {}) if resp.status_code == 200 else {}
        if data.get("usage") is not None:
            return AccountReading(float(data["usage"]), data.get("limit"), data.get("limit_remaining"), "key")
        resp = requests.get(f"{base}/credits", headers=headers, timeout=timeout)
        data = (resp.json().get("data") or {}) if resp.status_code == 200 else {}
        if data.get("total_usage") is not None:
            return AccountReading(float(data["total_usage"]), None, None, "credits")
    except requests.RequestException as e:
        raise RuntimeError(f"responses.base_url {base}: unreachable ({type(e).__name__})") from None
    except ValueError:
        pass
    return None
