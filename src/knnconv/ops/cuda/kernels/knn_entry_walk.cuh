// A CTA's walk over the contraction tiles of a channels-last gather (knn_gather_cl and its
// warpgroup-MMA variant): the entries of consecutive nodes in order, tiles_per_entry channel
// tiles an entry. The staging side and the multiplying side each step through the same tiles,
// one pipeline depth apart; the table values a staging step needs are read one entry (or node)
// ahead into registers, so no step waits on a global load for its addresses.
#pragma once

namespace knnconv {

struct EntryWalk {
  // the tile the staging side loads next: act row, weight cell, channel tile of the entry
  struct Step {
    long long row;
    int cell;
    int channel_tile;
  };

  const int* __restrict__ entry_start;
  const int* __restrict__ entry_row;
  const int* __restrict__ entry_cell;
  int nodes, last_node, last_entry, tiles_per_entry, tiles;
  int load_entry, load_channel, row_now, cell_now, row_next, cell_next;
  int compute_entry, compute_channel, computed, store_at, bound_now, bound_next;

  __device__ __forceinline__ EntryWalk(const int* start, const int* row, const int* cell,
                                       int first_node, int nodes_per_cta, int node_count,
                                       int channel_tiles)
      : entry_start(start), entry_row(row), entry_cell(cell), nodes(node_count),
        tiles_per_entry(channel_tiles) {
    last_node = min(first_node + nodes_per_cta, nodes);
    const int first_entry = entry_start[first_node];
    last_entry = entry_start[last_node];
    tiles = (last_entry - first_entry) * tiles_per_entry;
    load_entry = compute_entry = first_entry;
    load_channel = compute_channel = computed = 0;
    row_now = entry_at(first_entry, entry_row);
    cell_now = entry_at(first_entry, entry_cell);
    row_next = entry_at(first_entry + 1, entry_row);
    cell_next = entry_at(first_entry + 1, entry_cell);
    store_at = first_node;
    // entry_start[n + 1] bounds node n's entries: that of store_at and of the node after it
    bound_now = bound_of(first_node);
    bound_next = bound_of(first_node + 1);
  }

  __device__ __forceinline__ int entry_at(int e, const int* values) const {
    return e < last_entry ? values[e] : 0;
  }
  __device__ __forceinline__ int bound_of(int node) const {
    return node < nodes ? entry_start[node + 1] : 0;
  }

  // The staging side's next tile; the walk moves on to the one after it.
  __device__ __forceinline__ Step next_load() {
    const Step step{row_now, cell_now, load_channel};
    if (++load_channel == tiles_per_entry) {
      load_channel = 0;
      ++load_entry;
      row_now = row_next;
      cell_now = cell_next;
      row_next = entry_at(load_entry + 1, entry_row);
      cell_next = entry_at(load_entry + 1, entry_cell);
    }
    return step;
  }

  // Whether a node's entries all come before the tile the multiplying side takes next (nodes
  // without entries too; past the last tile, every node left): it is stored first.
  __device__ __forceinline__ bool node_done() const {
    return compute_channel == 0 && store_at < last_node && bound_now <= compute_entry;
  }
  // The node node_done() found; the walk moves on to the next.
  __device__ __forceinline__ int next_done_node() {
    const int node = store_at++;
    bound_now = bound_next;
    bound_next = bound_of(store_at + 1);
    return node;
  }
  // Whether a tile is left to multiply (the pipeline's last step has none: it only stores).
  __device__ __forceinline__ bool take_tile() { return computed++ != tiles; }
  __device__ __forceinline__ void tile_multiplied() {
    if (++compute_channel == tiles_per_entry) {
      compute_channel = 0;
      ++compute_entry;
    }
  }
};

}  // namespace knnconv
