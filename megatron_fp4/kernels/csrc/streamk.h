// Stream-K's chunk sequence (w4_wgmma.cu, STREAMK=1), in a header of its own so that a host build can test it
// (tests/test_cuda_decode.py compiles it with g++: DINL is then plain inline).
#pragma once
#ifndef DINL
#define DINL inline
#endif

// Stream-K (STREAMK=1): the grid is B blocks in one dimension, and block b takes the units [b U / B, (b + 1) U / B) of
// the U = row blocks x C (row block, chunk) units, so that every block has the same work whatever the number of row
// blocks (a split-K grid of whole row blocks leaves some SMs with more blocks than others: 296 row blocks of the 7B
// fc1 at 16 tokens are 3 on 32 SMs and 2 on 100). A row block shared by blocks b - 1 and b is summed in block order,
// deterministically: b - 1 takes the row block it ends in first and publishes its partial sums (ws[b - 1], then
// flags[b - 1] = 1), b takes the row block it starts in last, waits for the flag (long set by then), adds its own sums
// to the published ones and stores (or, where the row block goes on into b + 1, publishes them in turn), and clears
// the flag for the next launch. Each block's chunk sequence: the row block it ends in (its head, chunks [0, z)), the
// whole row blocks between, the row block it starts in (chunks [a, C)). A flag's waiter has the higher block index, so
// its publisher was dispatched before it (no deadlock).
struct StreamK {
  int C, r0, a, r1, z;  // C; the first unit's row block and chunk; the last unit's row block and its end (exclusive)
  int rb, c, end;       // the current row block, chunk, and the end of its segment
  DINL void init(int u0, int u1, int C_) {
    C = C_, r0 = u0 / C, a = u0 % C, r1 = (u1 - 1) / C, z = (u1 - 1) % C + 1;
    rb = r1, c = r0 == r1 ? a : 0, end = z;
  }
  DINL bool waits() const { return rb == r0 && a > 0; }     // the segment goes on from block b - 1
  DINL bool publishes() const { return rb == r1 && z < C; }  // ... into block b + 1
  DINL bool last() const { return c + 1 == end; }            // the current chunk ends its segment
  DINL void next() {  // to the next segment's first chunk (after r0's, the last, nothing is read)
    rb = rb == r1 ? (r0 + 1 < r1 ? r0 + 1 : r0) : (rb + 1 < r1 ? rb + 1 : r0);
    c = rb == r0 ? a : 0, end = C;
  }
  DINL void advance() { last() ? next() : (void)++c; }  // to the sequence's next chunk
};
// Block b's first unit (of B blocks over units): its units are [streamk_unit(b), streamk_unit(b + 1)).
DINL int streamk_unit(long long units, int b, int B) { return (int)(b * units / B); }
