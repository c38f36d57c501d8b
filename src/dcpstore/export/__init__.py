"""Exports of a committed DCP step to other formats, straight from the bucket to the bucket."""
