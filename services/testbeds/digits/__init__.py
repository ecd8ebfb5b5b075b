"""The digits testbed: a tiny DDPM UNet pre-trained here on 8x8 digits, scored by digit classifiers."""
