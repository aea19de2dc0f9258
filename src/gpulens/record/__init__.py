"""The run record: a directory that is complete at every moment."""

from gpulens.record.reader import RunRecord, list_records, read_record
from gpulens.record.writer import RunWriter, SeriesWriter

__all__ = ["RunRecord", "RunWriter", "SeriesWriter", "list_records", "read_record"]
