"""The bundled demo pair (a small code LM and its EAGLE-3 / EAGLE-3.1 drafters)."""
