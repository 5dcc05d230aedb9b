"""The refusal of one image input, raised by decoding (app/images.py) and by fetching a URL
(app/image_urls.py) alike; a module of its own so that neither imports the other back."""
from __future__ import annotations


class ImageRefused(ValueError):
    """This input cannot be used as an image; the message says why."""
