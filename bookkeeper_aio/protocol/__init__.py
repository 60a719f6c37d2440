"""Wire protocol shared by client and bookie: pure, bytes in and messages out, no I/O."""
