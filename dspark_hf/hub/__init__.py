"""The Hub side of a drafter: its model card and ``custom_generate/`` recipe, the upload, and the export to /
import from the serving engines' checkpoint formats."""
