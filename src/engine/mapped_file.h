// MappedFile: a read-only, private memory map of a whole file (POSIX mmap), move-only RAII.
// An empty file maps to {data() = nullptr, size() = 0}. Every failure (missing file, a directory,
// mmap refused) throws fasttree::Error naming the path and the OS reason.
#pragma once
#include <cstddef>
#include <string>

namespace fasttree {

class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const std::string& path);
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const unsigned char* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  void release() noexcept;

  std::string path_;
  const unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace fasttree
