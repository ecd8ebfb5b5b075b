"""The text-to-image testbed: a diffusers pipeline (SD 1.x/2.x, SDXL, SD3, FLUX) and prompt-image rewards."""
