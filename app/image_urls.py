"""Image URLs, fetched by the API with the same rules as webhooks: through `tasks.egress.fetch`
(resolve once, every address checked, the connection pinned to a checked address, no
redirects, a size cap and one total deadline: what is left of the job's, app/images.py). This
module only adapts its answers and errors to an input's refusal; it checks nothing itself."""
from __future__ import annotations

from app.image_errors import ImageRefused
from config import Settings
from tasks import egress


def fetch_image(url: str, settings: Settings, max_bytes: int, deadline_s: float) -> bytes:
    try:
        answer = egress.fetch(url, allow=settings.image_url_allow_list, method="GET",
                              body=None, headers={"Accept": "image/*"},
                              deadline_s=deadline_s, max_bytes=max_bytes)
    except egress.TooLarge:
        raise ImageRefused(f"the image at the URL is larger than {max_bytes} bytes") from None
    except egress.NotPublic as exc:
        raise ImageRefused(f"the URL is refused: {exc}; IQ_IMAGE_URL_ALLOW lists the hosts and "
                           "CIDRs allowed all the same") from None
    except egress.Refused as exc:
        raise ImageRefused(f"the URL is refused: {exc}") from None
    except egress.DeadlineExceeded:
        raise ImageRefused("the URL did not answer in time: the job's image URLs have "
                           f"{settings.image_fetch_deadline_s:g}s in all") from None
    except egress.EgressError as exc:
        raise ImageRefused(f"the URL could not be fetched: {exc}") from None
    if answer.status != 200:
        raise ImageRefused(f"the URL answered HTTP {answer.status}, not 200")
    return answer.body
