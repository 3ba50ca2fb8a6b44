"""Recording files: export a window of the recorded fleet (``lig record``) and publish it back
onto a NATS (``lig replay``). The file format is :mod:`recording.fileformat`."""
