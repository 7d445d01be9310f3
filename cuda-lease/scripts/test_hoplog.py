#!/usr/bin/env python3
"""Tests of hoplog.py's parser: python3 cuda-lease/scripts/test_hoplog.py"""
import os, sys, unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hoplog import parse_line


class ParseLine(unittest.TestCase):
    def test_span_close(self):
        line = ('node-batch{at_us=100 decode_us=3 order_us=0 worker_us=88 '
                'op=Batch bytes=4096}: close')
        self.assertEqual(parse_line(line), (
            "node-batch", "Batch", 4096, 100,
            [("decode", 3), ("order", 0), ("worker", 88)]))

    def test_span_with_parents_and_a_quoted_field(self):
        line = ('app{id=7}:worker-batch{at_us=5 enqueue_us=2 finish_us=9 '
                'ops=3 steps="alloc:1 write:0" op=Batch bytes=0}: close')
        self.assertEqual(parse_line(line), (
            "worker-batch", "Batch", 0, 5, [("enqueue", 2), ("finish", 9)]))

    def test_emitted_and_old_lines(self):
        self.assertEqual(
            parse_line("hop=bench-remote op=Chain bytes=0 at_us=9 "
                       "first_poll_us=4 wait_us=70"),
            ("bench-remote", "Chain", 0, 9, [("first_poll", 4), ("wait", 70)]))
        self.assertEqual(
            parse_line("hop=node op=MemWrite bytes=8 at_us=1 read_us=6"),
            ("node", "MemWrite", 8, 1, [("read", 6)]))

    def test_other_lines(self):
        self.assertIsNone(parse_line("INFO cuda_lease::node: listening"))
        self.assertIsNone(parse_line("conn{id=3}: close"))


if __name__ == "__main__":
    unittest.main()
