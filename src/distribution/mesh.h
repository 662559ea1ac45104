// DeviceMesh(shape, axis_names), as keras.distribution.DeviceMesh: the processes of the job laid out
// row-major on an n-dimensional grid; one sub-communicator per axis (the members that differ only in
// that axis' coordinate). The mesh size must equal the number of processes.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "distribution/communicator.h"

namespace meshtune {

class DeviceMesh {
 public:
  // Throws Error if the sizes or names are invalid (empty, non-positive, duplicate names, or a size
  // product different from comm.size(): "mesh 1x8 has 8 devices but the job has 2 processes").
  DeviceMesh(std::vector<int> shape, std::vector<std::string> axis_names, Communicator& comm);

  const std::vector<int>& shape() const { return shape_; }
  const std::vector<std::string>& axis_names() const { return names_; }
  int size() const;
  int axis_index(const std::string& name) const;  // -1 if absent
  int axis_size(int axis) const { return shape_[size_t(axis)]; }
  int coordinate(int axis) const { return coords_[size_t(axis)]; }  // this process' coordinate
  Communicator& axis_comm(int axis) { return *axis_comms_[size_t(axis)]; }
  Communicator& comm() { return comm_; }
  std::string describe() const;  // "(1, 8) ('batch', 'model')"

  // "1x8" -> {1, 8}; "batch,model" -> {"batch", "model"}. Throw Error on bad text.
  static std::vector<int> parse_shape(const std::string& text);
  static std::vector<std::string> parse_axes(const std::string& text);

 private:
  std::vector<int> shape_;
  std::vector<std::string> names_;
  std::vector<int> coords_;
  Communicator& comm_;
  std::vector<std::unique_ptr<Communicator>> axis_comms_;
};

}  // namespace meshtune
